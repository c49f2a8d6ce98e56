"""The quickstart's engine is hybrid: the scaling-out keys on it fail at load with the one override that fixes it."""

from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
FIX = "roles.actor_infer.hybrid=false"
SCALE_OUT = ["roles.actor_train.backend=fsdp2", "roles.actor_train.num_workers=2",
             "roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.num_workers=2",
             "roles.actor_infer.device_mapping=[0,1]"]


@pytest.mark.parametrize("overrides", [
    SCALE_OUT,  # the README's scaling-out snippet, as overrides
    ["roles.actor_infer.num_workers=2"],
    ["roles.actor_infer.device_mapping=[0,1]"],
    ["roles.actor_train.backend=fsdp2", "roles.actor_train.num_workers=2"],
    ["cluster.device=gpu"],
    ["cluster.weight_sync_transport=broadcast"],
])
def test_hybrid_errors_name_the_override_that_fixes_them(overrides):
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART, overrides)
    assert FIX in str(error.value)


def test_the_named_fix_makes_the_scaling_out_config_load():
    config = load_config(QUICKSTART, [*SCALE_OUT, FIX])
    assert not config.roles.actor_infer.hybrid
    assert config.roles.actor_infer.num_workers == 2 and config.roles.actor_train.backend == "fsdp2"
