"""Console lines stay whole when stdout is a file or a pipe (rich would wrap them at 80 columns there)."""

from __future__ import annotations

from rollflow.trackers import MetricsTracker


def test_long_console_lines_are_not_wrapped_in_a_pipe(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # rich's width when stdout is no terminal: 80, or $COLUMNS
    tracker = MetricsTracker(tmp_path, ["console"], total_steps=100)
    message = "moved " + "/a/long/run/directory" * 8 + " aside (resume=true continues a run instead)"
    tracker.print(message)
    tracker.log(1, {"reward/mean": 0.123456, "rollout/accuracy": 0.5, "eval/accuracy": 0.25,
                    "rollout/response_length": 123.4, "actor/kl": 0.001, "rollout/tokens_per_second": 12345.0,
                    "time/step": 1.5})
    lines = capsys.readouterr().out.splitlines()
    assert len(message) > 160 and lines[0] == message
    assert len(lines) == 2 and lines[1].startswith("step 1/100") and "step_s 1.5" in lines[1]
    tracker.close()
