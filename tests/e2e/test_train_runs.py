"""The real CLI, end to end through Ray, on the bundled tiny model and on a user model + dataset + reward.

The quickstart's first run is a `rollflow train` process of its own, as a user starts it (the entry point, its
prestarted Ray and warm worker); every other run is the command line's `main` in this process (the `cli`
fixture: the session's Ray and kept workers, no start-up of its own).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollflow.models import resolve_model_path
from tests.conftest import save_random_model

pytestmark = pytest.mark.slow

FAST = ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16",
        "data.eval.limit=16", "eval.every_steps=2", "output.trackers=[jsonl,tensorboard]"]


def _train_process(config: str, *overrides: str) -> subprocess.CompletedProcess:
    """`rollflow train` as a process of its own."""
    result = subprocess.run([sys.executable, "-m", "rollflow.cli", "train", config, *overrides],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _train(cli, config: str, *overrides: str):
    """`rollflow train` in this process (the `cli` fixture)."""
    result = cli("train", config, *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _changed_tensors(before_dir: str | Path, after_dir: Path) -> int:
    before = load_file(Path(before_dir) / "model.safetensors")
    after = load_file(after_dir / "model.safetensors")
    return sum(not torch.equal(before[name], after[name]) for name in before if name in after)


def test_quickstart_runs_writes_the_run_directory_and_resumes(tmp_path, cli):
    run_dir = tmp_path / "quick"
    _train_process("examples/quickstart.yaml", *FAST, "train.steps=2", "name=quick", f"output.dir={tmp_path}")
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "curves.png", "tensorboard"):
        assert (run_dir / name).exists(), name
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values())
    first = rows[1]
    assert first["check/logprob_max_abs_diff"] < 1e-3  # engine and trainer run the same model
    assert first["sync/version"] == 1 and rows[2]["sync/version"] == 2
    assert {"reward/mean", "rollout/accuracy", "rollout/response_length", "actor/approx_kl", "grad_norm",
            "rollout/tokens_per_second", "time/step", "eval/accuracy"} <= set(rows[2])
    model_dir = run_dir / "checkpoints" / "step_2" / "model"
    assert _changed_tensors(resolve_model_path("tiny"), model_dir) > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).chat_template
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "reward", "answer"} <= set(samples[0])
    _check_timeline(run_dir, how="prestarted")

    # Resume: continues at step 3 from the step-2 checkpoint (model, optimizer, data position).
    result = _train(cli, "examples/quickstart.yaml", *FAST, "train.steps=4", "name=quick", f"output.dir={tmp_path}",
                    "resume=true")
    assert "resumed from" in result.stdout
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    state = json.loads((run_dir / "checkpoints" / "step_4" / "driver_state.json").read_text())
    assert state["step"] == 4 and state["stream"]["sampler"]["position"] == 16  # 4 steps x 4 prompts
    assert state["stream"]["pending"] == []  # a synchronous step leaves nothing in flight
    assert _changed_tensors(model_dir, run_dir / "checkpoints" / "step_4" / "model") > 0


def _check_timeline(run_dir: Path, hybrid: bool = True, how: str = "running") -> None:
    """timeline.json has a lane per worker of placement.json, with each phase a step runs there, and every
    worker span of a step inside that step's driver span; timeline.png exists. `hybrid`: the engine runs in
    actor_train's process (the quickstart), its spans in a lane of its own all the same. `how`: how the run got
    Ray; "prestarted" (a `rollflow train` process: the command line's own Ray) also means the warm worker that
    Ray started ahead was taken over by actor_train."""
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    names: dict[str, set] = {}
    for e in events:
        if e["ph"] == "X":
            names.setdefault(lanes[e["pid"]], set()).add(e["name"])
    placement = json.loads((run_dir / "placement.json").read_text())
    workers = {f"{role} {w['worker']}" for role, ws in placement.items() for w in ws}
    assert set(names) == workers | {"driver"}, names
    assert {"check inputs", "start ray", "start workers", "eval", "step", "rollout", "actor_train", "weight_sync",
            "log", "checkpoint"} <= names["driver"]
    assert {"start", "init_backend", "compute_logprobs", "train", "save"} <= names["actor_train 0"]
    if hybrid:
        assert placement["actor_infer"][0]["in"] == "actor_train"
        assert names["actor_infer 0"] == {"generate_batch", "sync_engine"}
        assert not {"generate_batch", "sync_engine", "weights_for_sync"} & names["actor_train 0"]
    else:
        assert "weights_for_sync" in names["actor_train 0"]
        assert {"start", "generate_batch", "update_weights", "offload", "onload"} <= names["actor_infer 0"]
    # the driver checks its inputs while the workers start (after Ray: a thread would share its GIL)
    (ray_start,) = [e for e in events if e["name"] == "start ray"]
    assert ray_start["args"] == {"how": how}
    if how == "prestarted":
        assert [lanes[e["pid"]] for e in events if e["name"] == "warm up"] == ["actor_train 0"]
    (check,) = [e for e in events if e["name"] == "check inputs"]
    (start,) = [e for e in events if e["name"] == "start workers"]
    assert ray_start["ts"] + ray_start["dur"] <= min(start["ts"], check["ts"])
    assert check["ts"] < start["ts"] + start["dur"] and start["ts"] < check["ts"] + check["dur"]
    steps = [e for e in events if e["name"] == "step"]
    trains = [e for e in events if e["name"] == "train"]
    assert len(steps) == len(trains) == 2
    for step, train in zip(sorted(steps, key=lambda e: e["ts"]), sorted(trains, key=lambda e: e["ts"])):
        assert step["ts"] <= train["ts"] and train["ts"] + train["dur"] <= step["ts"] + step["dur"]
    assert (run_dir / "timeline.png").stat().st_size > 1000


def test_user_model_dataset_and_dotted_path_reward(tmp_path, cli, monkeypatch):
    """A local HF model, a JSONL dataset with an extra column, a reward by dotted path, KL to a reference."""
    model_dir = save_random_model(tmp_path / "my_model", seed=3)
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"say {w}", "answer": w, "bonus": i % 2} for i, w in enumerate(["ab", "cd", "ef", "gh"])]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    package = tmp_path / "user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(textwrap.dedent("""
        def overlap(completion, *, answer, bonus, **row):
            # fraction of answer characters present, plus the dataset's extra column, plus a small
            # text-dependent term so a random model's samples do not all score the same (zero advantages)
            spread = sum(map(ord, completion)) % 10 / 100
            return sum(c in completion for c in answer) / len(answer) + 0.1 * bonus + spread
    """))
    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(f"""
        name: user
        model: {{path: {model_dir}}}
        data:
          train: {{path: {data}}}
          eval: {{path: {data}}}
        rollout: {{groups_per_step: 4, group_size: 4, max_new_tokens: 5}}
        reward:
          functions: [{{name: "user_pkg.scoring:overlap"}}, {{name: exact_match, weight: 0.5}}]
        algorithm: {{kl_loss_coef: 0.05}}  # starts the reference worker
        train: {{steps: 2, lr: 1.0e-3, train_micro_batch_size: 16}}
        eval: {{every_steps: 1}}
        output: {{dir: {tmp_path}, trackers: [jsonl]}}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward is scored on the driver
    _train(cli, str(config))
    rows = _metrics(tmp_path / "user")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"rollout/reward/user_pkg.scoring:overlap", "rollout/reward/exact_match"} <= set(rows[1])
    assert rows[1]["rollout/reward/user_pkg.scoring:overlap"] >= 0.0
    assert rows[1]["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert rows[2]["actor/kl"] >= 0.0  # > 0 unless step 1 had all-zero advantages (no update)
    assert _changed_tensors(model_dir, tmp_path / "user" / "checkpoints" / "step_2" / "model") > 0
    _check_timeline(tmp_path / "user", hybrid=False)  # separate engine worker, and a reference worker


def test_eval_command_scores_a_model(tmp_path, cli):
    result = cli("eval", "--model", "tiny", "data.eval.limit=20", f"output.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(next(line for line in result.stdout.splitlines() if line.startswith("eval/accuracy:"))
                     .split(":")[1])
    assert 0.0 < accuracy < 1.0  # the bundled model gets some, not all, of the held-out sums right
    assert len((tmp_path / "eval-tiny" / "eval_samples.jsonl").read_text().splitlines()) == 20


def test_quickstart_learns(tmp_path, cli):
    """A short version of the quickstart: held-out greedy accuracy and training reward both rise."""
    # lr pinned: the quickstart's own (3e-4, tuned for its 120 cosine steps) dips early at a constant rate
    _train(cli, "examples/quickstart.yaml", "train.steps=12", "train.lr_schedule=constant", "train.lr=2.0e-4",
           "eval.every_steps=12",
           "data.eval.limit=200", "output.trackers=[jsonl]", "name=learn", f"output.dir={tmp_path}")
    rows = _metrics(tmp_path / "learn")
    initial, final = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert final >= initial + 0.10, (initial, final)
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
