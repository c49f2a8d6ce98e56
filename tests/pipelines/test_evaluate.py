"""`rollflow eval` when rewards fail: every sample failed is one line and a non-zero exit (an accuracy of 0 would
mean nothing), some failed is a warning; either way their errors are in `eval_samples.jsonl`. The engines are
replaced by a core that answers every prompt at once (no Ray)."""

from __future__ import annotations

import contextlib
import json

import pytest

from rollflow.cli import main
from rollflow.data.sample import Sample, SampleStatus


class _Core:
    """The rollout core `run_eval` drives: each prompt answered, failed where `fails(row)` says so."""

    def __init__(self, fails):
        self.fails, self.program = fails, None

    def evaluate(self, prompts, program):
        samples = []
        for prompt in prompts:
            sample = Sample(prompt.token_ids, [1], [-0.1], response_text="x", row=prompt.row, reward=0.0)
            if self.fails(prompt.row):
                sample.status = SampleStatus.FAILED
                sample.metadata["error"] = f"ValueError: no score for {prompt.row['answer']}"
            samples.append(sample)
        return samples

    def close(self):
        pass


@pytest.fixture
def eval_with(monkeypatch, tmp_path):
    """`rollflow eval` of 4 rows whose core fails the rows `fails(row)` picks: (exit status, stderr, samples)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    monkeypatch.setattr("rollflow.pipelines.evaluate.running_roles", lambda *args, **kwargs: contextlib.nullcontext({}))

    def run(fails, capsys):
        monkeypatch.setattr("rollflow.pipelines.evaluate.prompt_rollout", lambda *args, **kwargs: _Core(fails))
        status = main(["eval", "--model", "tiny", "--data", str(data), f"output.dir={tmp_path}/runs"])
        samples = tmp_path / "runs" / "eval-tiny" / "eval_samples.jsonl"
        return status, capsys.readouterr().err, [json.loads(line) for line in samples.read_text().splitlines()]

    return run


def test_every_sample_failing_is_one_line_and_their_errors_are_kept(eval_with, capsys):
    status, err, samples = eval_with(lambda row: True, capsys)
    assert status != 0
    assert err == "rollflow: error: eval: all 4 samples failed; the first failed with: ValueError: no score for 1\n"
    assert [s["error"] for s in samples] == [f"ValueError: no score for {a + 1}" for a in range(4)]


def test_some_samples_failing_is_a_warning(eval_with, capsys):
    status, err, samples = eval_with(lambda row: row["answer"] in ("2", "4"), capsys)
    assert status == 0
    assert err == ("rollflow: warning: eval: 2 of 4 samples failed; the first failed with: ValueError: no score "
                   "for 2 (each failed sample's error is in eval_samples.jsonl; failed samples count as wrong)\n")
    assert [s["status"] for s in samples] == ["finished", "failed", "finished", "failed"]
