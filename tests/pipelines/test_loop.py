"""The driver frame (`rollflow.pipelines.loop`): what it gives every pipeline. Each pipeline is a step object
with the same protocol and no branch names a pipeline; an interrupted run of any of them saves its last
finished step (`output.save_on_interrupt`) and resumes from it."""

from __future__ import annotations

import ast
import json
import os
import signal
import time
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.pipelines import PIPELINES
from rollflow.pipelines.agentic import AgenticStep
from rollflow.pipelines.loop import PipelineStep
from rollflow.pipelines.rlvr import RLVRStep
from rollflow.pipelines.supervised import DistillStep, DPOStep, SFTStep
from rollflow.workers.objectives import OBJECTIVES, PreferenceLoss
from rollflow.workers.specs import worker_specs

PIPELINE_DIR = Path(__file__).resolve().parents[2] / "rollflow" / "pipelines"
STEPS = {"rlvr": RLVRStep, "agentic": AgenticStep, "sft": SFTStep, "dpo": DPOStep, "distill": DistillStep}


def _names_the_pipeline(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "pipeline") or \
        (isinstance(node, ast.Name) and node.id == "pipeline")


@pytest.mark.parametrize("path", sorted(PIPELINE_DIR.glob("*.py")), ids=lambda path: path.name)
def test_no_branch_compares_the_pipeline_name(path):
    """What differs between pipelines is their step class, never `if config.pipeline == "dpo"`."""
    tree = ast.parse(path.read_text())
    compared = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(_names_the_pipeline(side) for side in [node.left, *node.comparators])]
    assert not compared, f"{path.name} compares the pipeline name on lines {compared}"


def test_every_pipeline_has_a_step_class_with_the_whole_protocol():
    assert {name: PIPELINES[name].step_class() for name in PIPELINES} == STEPS
    members = [name for name in dir(PipelineStep) if not name.startswith("_")]
    members += list(PipelineStep.__annotations__)
    for name, step_class in STEPS.items():
        missing = [member for member in members if not hasattr(step_class, member) and member != "config"]
        assert not missing, f"{name}: {missing}"
        assert "checkpoint" in step_class.phases  # the interrupt's save onloads it
        assert step_class.objective in OBJECTIVES  # the trainer's objective, by the registry's name


def test_the_objective_and_roles_follow_the_step_class():
    dpo = load_config(None, ["pipeline=dpo", "data.train.path=pairs.jsonl"])
    distill = load_config(None, ["pipeline=distill", "data.train.task=add2", "roles.reference.model_path=tiny"])
    sft = load_config(None, ["pipeline=sft", "data.train.task=add2"])
    assert PIPELINES.get("dpo").roles_of(dpo) == ["actor_train", "reference"]
    assert PIPELINES.get("distill").roles_of(distill) == ["actor_train", "reference"]
    assert PIPELINES.get("sft").roles_of(sft) == ["actor_train"]
    # each worker's spec, as the frame builds them: DPO's trainer minimizes the preference loss, beside a frozen
    # reference
    step = PIPELINES["dpo"].step_class()(dpo)
    specs = worker_specs(dpo, PIPELINES.get("dpo").roles_of(dpo), step.objective)
    assert isinstance(specs["actor_train"].loss, PreferenceLoss) and specs["actor_train"].settings.trainable
    assert specs["reference"].loss is None and not specs["reference"].settings.trainable


def _interrupt_at(step_class, monkeypatch, at_step: int) -> None:
    """SIGINT arrives while `at_step` rolls out (outside the critical section), as Ctrl-C would."""
    rollout = step_class.rollout

    def interrupted_rollout(self, step):
        if step == at_step:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler raises `Interrupted` in here
        return rollout(self, step)

    monkeypatch.setattr(step_class, "rollout", interrupted_rollout)


AGENTIC = ["pipeline=agentic", "env.id=frozenlake", "env.kwargs={size: 3, max_turns: 4}", "env.max_turns=4",
           "rollout.groups_per_step=2", "rollout.group_size=2", "eval.episodes=2"]
SFT = ["pipeline=sft", "model.path=tiny", "data.train={task: add2, limit: 64}", "data.response_key=answer",
       "data.eval={task: add2, split: eval, limit: 8}", "train.batch_size=8", "train.train_micro_batch_size=8"]


@pytest.mark.slow
@pytest.mark.parametrize(("step_class", "overrides"), [(AgenticStep, AGENTIC), (SFTStep, SFT)],
                         ids=["agentic", "sft"])
def test_an_interrupted_run_saves_its_last_finished_step_and_resumes(ray_session, tmp_path, monkeypatch, capsys,
                                                                      step_class, overrides):
    run = [*overrides, f"output.dir={tmp_path}", "name=run", "output.trackers=[jsonl]", "eval.every_steps=0",
           "output.save_every_steps=0"]
    from rollflow.pipelines import run as runner
    with monkeypatch.context() as patch:
        _interrupt_at(step_class, patch, at_step=2)
        with pytest.raises(KeyboardInterrupt):
            runner(load_config(None, [*run, "train.steps=3"]), manage_ray=False)
    assert "interrupted: saving step 1 (interrupt again to skip it)" in capsys.readouterr().out
    assert (tmp_path / "run" / "curves.png").is_file()  # what it logged is drawn, as at a run's end
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "driver_state.json").read_text())
    assert state["step"] == 1 and "initial_eval" in state

    runner(load_config(None, [*run, "train.steps=2", "resume=true"]), manage_ray=False)
    assert "resumed from" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # the initial eval, the saved step, the one resumed: each once
