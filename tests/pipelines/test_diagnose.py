"""`rollflow diagnose RUN_DIR` reads a run directory and names the lever that fits where the step time went:
placement first when the engines share the trainer's devices, asynchronous training when rollout and training
could overlap, nothing more from async when the trainer is the bottleneck, tail batching or partial rollout for
a long tail, reward concurrency for reward waits."""

from __future__ import annotations

import json

import pytest

from rollflow.cli import main
from rollflow.config import dump_config, load_config
from rollflow.errors import ConfigError
from rollflow.pipelines.diagnose import diagnose

DISAGGREGATED = ["roles.actor_infer.hybrid=false", "roles.actor_train.device_mapping=[0]",
                 "roles.actor_infer.device_mapping=[1]"]


def _run_dir(tmp_path, overrides: list[str], step: dict[str, float], steps: int = 6):
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(load_config("examples/quickstart.yaml", overrides)))
    rows = [{"step": 0, "eval/accuracy": 0.1}] + [{"step": s, **step} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def _levers(tmp_path, overrides, **step) -> list[str]:
    return diagnose(_run_dir(tmp_path, overrides, {f"time/{k}" if k in ("step", "rollout", "train", "reward_wait")
                                                   else k: v for k, v in step.items()})).levers


def test_engines_on_the_trainers_devices_come_first(tmp_path):
    levers = _levers(tmp_path, [], step=1.0, rollout=0.45, train=0.45)  # the quickstart's hybrid engine
    assert len(levers) == 1 and levers[0].startswith("asynchronous training cannot help as placed: the engine "
                                                     "runs inside actor_train's worker")


def test_a_synchronous_disaggregated_run_is_told_what_async_would_give(tmp_path):
    levers = _levers(tmp_path, DISAGGREGATED, step=1.0, rollout=0.5, train=0.4, **{"sync/seconds": 0.05})
    assert levers[0].startswith("asynchronous training (rollout.max_staleness: 1) overlaps the rollout (0.500 s) "
                                "with training (0.400 s): predicted step 0.600 s, 1.67x")


def test_a_rollout_that_waits_is_told_async_helps_even_on_the_trainers_devices(tmp_path):
    """The io-bound workload's shape (bench/async_speedup.py --workload io_bound): the quickstart's hybrid engine,
    a step mostly waiting for a judge. The waits need no device, so async is named (with a device of its own for
    the engine), not refused as placed; the prediction takes the tail off the rollout."""
    levers = _levers(tmp_path, [], step=3.7, rollout=3.15, train=0.5, reward_wait=1.6,
                     **{"rollout/tail_wait_seconds": 0.8})
    assert levers[0].startswith("asynchronous training: the rollout waits 2.400 s of the step for rewards and its "
                                "last groups")
    assert "give actor_infer a device of its own (the engine runs inside actor_train's worker" in levers[0]
    assert "predicted step 2.400 s, 1.54x" in levers[0]  # max(3.15 - 0.8, 0.5) + the rest (0.05)
    assert not any("cannot help as placed" in lever for lever in levers)
    # a rollout that computes (no waits) on the same devices is still told to move the engine first
    levers = _levers(tmp_path / "computing", [], step=1.0, rollout=0.45, train=0.45, reward_wait=0.0)
    assert levers[0].startswith("asynchronous training cannot help as placed")


def test_a_trainer_bound_asynchronous_run_is_told_async_cannot_help_more(tmp_path):
    levers = _levers(tmp_path, [*DISAGGREGATED, "rollout.max_staleness=1"], step=0.86, rollout=0.001, train=0.76)
    assert len(levers) == 1 and "the trainer is the bottleneck (88% of the step): the rollout is already hidden" \
        in levers[0]


def test_a_long_tail_and_reward_waits_are_named(tmp_path):
    levers = _levers(tmp_path, ["rollout.deterministic=false"], step=80.0, rollout=67.0, train=3.0,
                     **{"rollout/tail_wait_seconds": 40.0, "time/reward_wait": 15.0})
    assert any(lever.startswith("a long tail: the last tenth of groups holds the step 40.000 s; tail batching")
               for lever in levers)
    assert any(lever.startswith("rewards: the step waits 15.000 s") for lever in levers)


def test_exact_old_logprobs_that_cost_a_sizeable_part_of_the_step_are_named(tmp_path):
    """The io-bound workload's asynchronous run with exact old logprobs: 0.41 s of its 2.82 s step is the forward
    pass per sampling version, shown under the rest and named as what `current` would save."""
    async_exact = [*DISAGGREGATED, "rollout.max_staleness=1", "algorithm.old_logprobs=exact"]
    diagnosis = diagnose(_run_dir(tmp_path, async_exact, {"time/step": 2.82, "time/rollout": 1.63, "time/train": 0.75,
                                                          "time/old_logprobs": 0.41}))
    assert diagnosis.parts["  of which old logprobs"] == 0.41
    assert any(lever.startswith("exact old logprobs cost 0.410 s a step (15%") and "fine at max_staleness 1"
               in lever for lever in diagnosis.levers)
    current = diagnose(_run_dir(tmp_path / "current", DISAGGREGATED, {"time/step": 2.8, "time/rollout": 1.6,
                                                                      "time/train": 0.75}))
    assert "  of which old logprobs" not in current.parts
    assert not any(lever.startswith("exact old logprobs") for lever in current.levers)


def test_offload_and_onload_between_phases_are_named(tmp_path):
    """A colocated run whose step is mostly its roles moving between phases (the planner's short-response
    synchronous placement): the moves are shown under the rest, summed over phases, and named."""
    diagnosis = diagnose(_run_dir(tmp_path, [], {"time/step": 0.77, "time/rollout": 0.18, "time/train": 0.06,
                                                 "time/rollout_offload_onload": 0.2,
                                                 "time/actor_train_offload_onload": 0.23}))
    assert diagnosis.parts["  of which offload / onload between phases"] == pytest.approx(0.43)
    assert diagnosis.levers[0].startswith("colocated roles moving off and onto their devices between phases take "
                                          "0.430 s of the step (56%): engines on devices of their own")


def test_a_simulated_run_gets_the_planners_predicted_gain(tmp_path):
    """A simulated synchronous run with a long tail: beside the levers, what the planner simulated for its config
    (the `plan.json` of `rollflow plan`, which made the run), or where no plan made it, the command that would."""
    from rollflow.pipelines.plan import Candidate, simulated_overrides

    sync = Candidate(8, 8, True, 0)
    overrides = [*simulated_overrides(sync, "h800-7b", 20.0, 16, 8192, 6), "rollout.deterministic=false"]
    step = {"time/step": 80.0, "time/rollout": 67.0, "time/train": 3.0, "rollout/tail_wait_seconds": 40.0}
    plan_dir = tmp_path / "plan"
    run_dir = _run_dir(plan_dir, overrides, step)
    run_dir.rename(plan_dir / sync.name)
    run_dir = plan_dir / sync.name
    levers = diagnose(run_dir).levers
    assert levers[-1] == (f"to predict each lever's gain on this simulated cluster: rollflow plan {run_dir}/config.yaml "
                          "--gpus 8 --profile h800-7b simulates the synchronous and asynchronous placements (K = 1, "
                          "2) and names the fastest")
    asynchronous = Candidate(4, 4, False, 1)
    plan = {"profile": "h800-7b", "gpus": 8, "best": asynchronous.name, "candidates": [
        {"name": asynchronous.name, "describe": asynchronous.describe(), "max_staleness": 1, "samples_per_s": 12.0},
        {"name": sync.name, "describe": sync.describe(), "max_staleness": 0, "samples_per_s": 6.0}]}
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    levers = diagnose(run_dir).levers
    assert any(lever.startswith("a long tail") for lever in levers)
    assert levers[-1] == (f"the planner's simulation ({plan_dir}/plan.json) of 2 placements on 8 h800-7b GPUs: the "
                          "fastest is asynchronous (max_staleness 1): 4 GPUs train, 4 engines, 2.00x the synchronous "
                          "one; this run (synchronous, trainer and 8 engines colocated on all 8 GPUs) is 1.00x")
    for broken in ('{"candidates": [{"name": "x"}], "best": "x"}', '{"profile": "h800-7b", "gp'):  # not a plan's
        (plan_dir / "plan.json").write_text(broken)
        assert diagnose(run_dir).levers[-1].startswith("to predict each lever's gain on this simulated cluster")
    # a run on this machine's devices gets no planner line: the planner simulates a profile, not this machine
    assert not any("planner" in lever or "rollflow plan" in lever
                   for lever in _levers(tmp_path / "cpu", ["rollout.deterministic=false"], step=80.0, rollout=67.0,
                                        train=3.0, **{"rollout/tail_wait_seconds": 40.0}))


def test_the_command_prints_the_split_and_refuses_what_is_not_a_run(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, DISAGGREGATED, {"time/step": 1.0, "time/rollout": 0.5, "time/train": 0.4})
    assert main(["diagnose", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 steps measured (after the first 2); median step 1.000 s:")
    assert "waiting for the rollout" in out and "50.0%" in out and "what would help:" in out
    with (run_dir / "metrics.jsonl").open("a") as file:  # a run still writing: its last line torn
        file.write('{"step": 7, "time/st')
    assert main(["diagnose", str(run_dir)]) == 0 and capsys.readouterr().out == out
    assert main(["diagnose", str(tmp_path / "nothing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no step after the first 2"):
        diagnose(_run_dir(tmp_path / "short", [], {"time/step": 1.0}, steps=2))
