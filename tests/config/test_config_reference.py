import difflib
import re
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import BaseModel, Field

from rollflow.config import (
    PIPELINES,
    DatasetConfig,
    LoraConfig,
    RewardFunctionConfig,
    TrainInferCorrectionConfig,
    dump_config,
    load_config,
)
from rollflow.config.reference import main, render_config_reference

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
REGENERATE = "python -m rollflow.config.reference docs/config.md"


def reachable_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """`model` and every model its fields hold, directly or inside `X | None`, `list[X]`, ..."""
    found: list[type[BaseModel]] = []
    pending = [model]
    while pending:
        current = pending.pop()
        if current in found:
            continue
        found.append(current)
        for field in current.model_fields.values():
            pending += [arg for arg in _leaf_types(field.annotation)
                        if isinstance(arg, type) and issubclass(arg, BaseModel)]
    return found


def _leaf_types(annotation: Any) -> list[Any]:
    args = get_args(annotation)
    return [annotation] if not args else [leaf for arg in args for leaf in _leaf_types(arg)]


def undescribed_fields(model: type[BaseModel]) -> list[str]:
    """`Model.field` for every field reachable from `model` without a non-empty description."""
    return [f"{reached.__name__}.{name}" for reached in reachable_models(model)
            for name, field in reached.model_fields.items() if not (field.description or "").strip()]


def table_rows(text: str, pipeline: str = "rlvr") -> dict[str, tuple[str, str, str]]:
    """Key -> (type, default, description) of every table row `| `key` | `type` | default | description |` of
    the keys every pipeline has and of `pipeline`'s own sections (other pipelines may reuse a key's name)."""
    rows = {}
    other_pipeline = False
    for line in text.splitlines():
        if line.startswith("## "):
            other_pipeline = line.startswith("## Pipeline `") and line != f"## Pipeline `{pipeline}`"
        match = not other_pipeline and re.match(r"^\| `([^`]+)` \| `(.*?)` \| (.*?) \| (.*) \|$", line)
        if match:
            assert match.group(1) not in rows, f"key {match.group(1)} has two rows"
            rows[match.group(1)] = (match.group(2), match.group(3), match.group(4))
    return rows


def leaf_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of a config tree's values that are not sections (a `null` section counts as a value)."""
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys += leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def test_committed_config_doc_is_the_rendered_reference():
    rendered = render_config_reference()
    committed = CONFIG_DOC.read_bytes().decode("utf-8")
    lines = difflib.unified_diff(committed.splitlines(), rendered.splitlines(), "docs/config.md", "rendered",
                                 lineterm="")
    diff = "\n".join(list(lines)[:40])
    assert rendered.encode("utf-8") == CONFIG_DOC.read_bytes(), (
        f"docs/config.md is not what the config schema renders; run `{REGENERATE}` and commit it.\n{diff}")


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_every_config_field_has_a_description(pipeline):
    missing = undescribed_fields(PIPELINES[pipeline].config)
    assert not missing, (f"config fields without Field(description=...): {', '.join(missing)}; describe "
                         f"them, then run `{REGENERATE}`")


def test_the_description_check_reaches_nested_optional_and_list_sections():
    reached = reachable_models(PIPELINES["rlvr"].config)
    for nested in (DatasetConfig, LoraConfig, TrainInferCorrectionConfig, RewardFunctionConfig):
        assert nested in reached

    class Inner(BaseModel):
        described: int = Field(default=0, description="A described field.")
        bare: int = 0

    class Outer(BaseModel):
        items: list[Inner] = Field(default=[], description="A list of sections.")
        maybe: Inner | None = None

    assert undescribed_fields(Outer) == ["Outer.maybe", "Inner.bare"]


def test_reference_has_the_keys_users_look_for():
    rows = table_rows(render_config_reference())
    for key in ("roles.actor_train.backend", "roles.actor_train.backend_kwargs",
                "roles.actor_train.lora.rank", "roles.actor_infer.max_in_flight_requests",
                "roles.actor_infer.engine_kwargs",
                "roles.reference.backend", "roles.critic.backend", "roles.reward.device_mapping",
                "checks.weight_checksum", "cluster.weight_sync_transport", "algorithm.difficulty_mask",
                "algorithm.train_infer_correction.mask_level", "data.eval.limit", "reward.functions[].name",
                "rollout.groups_per_step", "pipeline"):
        assert key in rows, f"{key} is missing from the config reference"
    assert rows["checks.weight_checksum"][:2] == (r'"full" \| "bucket" \| "off"', "`bucket`")
    assert rows["cluster.weight_sync_transport"][:2] == (r'"object_store" \| "broadcast"', "`object_store`")
    assert rows["algorithm.difficulty_mask"][:2] == (r"[float, float] \| null", "`null`")
    assert rows["roles.actor_train.lora.dropout"][0] == "float in [0, 1)"
    assert rows["rollout.top_p"][0] == "float in (0, 1]"
    assert rows["roles.actor_train.device_mapping"][0] == r"list[int] \| null"
    assert rows["train.lr"][1] == "`1.0e-05`"
    assert rows["data.eval"][1] == "`{task: add2, split: eval, limit: 200}`"
    assert rows["data.eval.limit"][1] == "`200`"  # the value in data.eval's default, not DatasetConfig's null
    assert rows["reward.functions[].name"][1] == "required"
    assert "[algorithms.md](algorithms.md)" in rows["algorithm.advantage"][2]


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_reference_lists_every_key_of_each_pipelines_default_config(pipeline):
    rows = table_rows(render_config_reference(), pipeline)
    needs_data = pipeline not in ("rlvr", "agentic")  # rlvr has a default dataset, agentic reads none
    overrides = [f"pipeline={pipeline}"] + (["data.train.task=add2"] if needs_data else []) \
        + (["roles.reference.model_path=tiny"] if pipeline == "distill" else [])
    printed = yaml.safe_load(dump_config(load_config(None, overrides)))  # what --print-config prints
    missing = [key for key in leaf_keys(printed) if key not in rows]
    assert not missing, f"keys of --print-config missing from the reference: {', '.join(missing)}"


def test_main_writes_the_file_or_prints_it(tmp_path, capsys):
    target = tmp_path / "config.md"
    assert main([str(target)]) == 0
    assert target.read_bytes() == render_config_reference().encode("utf-8")
    assert main([]) == 0
    assert capsys.readouterr().out == render_config_reference()
