"""One vocabulary for rollout and loss settings across pipelines: the shared keys mean the same in RLVR and
agentic configs, and the old RLVR names are still read for one release, with a warning."""

import pytest

from rollflow.config import load_config
from rollflow.config.agentic import AgenticAlgorithmConfig, AgenticRolloutConfig
from rollflow.config.rlvr import AlgorithmConfig, LossFields, RolloutConfig
from rollflow.config.rollout_fields import RENAMED, GroupFlowFields, SamplingFields
from rollflow.errors import ConfigError


def test_rlvr_and_agentic_share_the_rollout_and_loss_keys():
    shared = set(GroupFlowFields.model_fields) | set(SamplingFields.model_fields)
    assert shared <= set(RolloutConfig.model_fields) and shared <= set(AgenticRolloutConfig.model_fields)
    assert set(LossFields.model_fields) <= set(AlgorithmConfig.model_fields) & set(AgenticAlgorithmConfig.model_fields)
    # the agentic rollout now has the core's whole policy under the RLVR names
    assert {"overprovision", "long_round_every", "partial_rollout", "deterministic"} <= set(
        AgenticRolloutConfig.model_fields)


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_an_old_name_is_read_as_the_new_one_with_a_warning(old, new, capsys):
    config = load_config(None, ["pipeline=rlvr", f"rollout.{old}=4"])
    assert getattr(config.rollout, new) == 4
    assert f"rollflow: warning: rollout.{old} is now rollout.{new}" in capsys.readouterr().err


def test_old_and_new_name_together_is_one_line():
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_step is the old name of rollout.groups_per_step, "
                                          r"and both are set"):
        load_config(None, ["pipeline=rlvr", "rollout.prompts_per_step=3", "rollout.groups_per_step=4"])


@pytest.mark.parametrize("pipeline", ["examples/async.yaml", "examples/agentic_frozenlake.yaml"])
def test_an_asynchronous_rollout_turns_the_train_infer_correction_on_in_both_pipelines(pipeline):
    devices = ["roles.actor_train.device_mapping=[0]", "roles.actor_infer.device_mapping=[1]"]
    asynchronous = load_config(pipeline, ["rollout.max_staleness=1", *devices])
    assert asynchronous.algorithm.train_infer_correction is not None  # TIS by default
    explicit = load_config(pipeline, ["rollout.max_staleness=1", "algorithm.train_infer_correction=null", *devices])
    assert explicit.algorithm.train_infer_correction is None  # a user's choice stands
