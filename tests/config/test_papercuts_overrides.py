"""Overrides that replace a dataset's source (`data.train.path=X` over a `task:`), and overrides into lists
(`reward.functions[0].weight=0.5`), through the real command line and `load_config`."""

from __future__ import annotations

import pytest
import yaml

from rollflow.cli import EXIT_USER_ERROR, main
from rollflow.config import load_config
from rollflow.errors import ConfigError

QUICKSTART = "examples/quickstart.yaml"  # data.train: {task: add2, split: train}


def _printed_config(capsys, *argv: str) -> dict:
    assert main(["train", QUICKSTART, *argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_a_path_override_replaces_the_configs_task_and_the_other_way_round(capsys):
    data = _printed_config(capsys, "data.train.path=rows.jsonl")["data"]
    assert data["train"]["path"] == "rows.jsonl" and data["train"]["task"] is None
    config = load_config(QUICKSTART, ["data.train.path=owner/name", "data.train.subset=main",
                                      "data.train.task=sum3"])  # the last source set wins, subset goes with it
    assert (config.data.train.task, config.data.train.path, config.data.train.subset) == ("sum3", None, None)
    # the default eval set (a task) and a domain's set, which start from no file at all
    assert load_config(None, ["data.eval.path=e.jsonl"]).data.eval.path == "e.jsonl"
    domains = load_config("examples/multi_domain.yaml", ["data.domains.add2.eval.path=e.jsonl"]).data.domains
    assert (domains["add2"].eval.task, domains["add2"].eval.path) == (None, "e.jsonl")


def test_both_sources_in_one_file_or_one_value_stay_an_error(tmp_path):
    config = tmp_path / "both.yaml"
    config.write_text("data:\n  train: {task: add2, path: rows.jsonl}\n")
    with pytest.raises(ConfigError, match="set exactly one of `task`"):
        load_config(config)
    with pytest.raises(ConfigError, match="set exactly one of `task`"):
        load_config(None, ["data.train={task: add2, path: rows.jsonl}"])
    with pytest.raises(ConfigError, match="set exactly one of `task`"):  # null removes, it replaces nothing
        load_config(QUICKSTART, ["data.train.task=null"])


def test_list_items_are_overridden_by_index(capsys):
    reward = _printed_config(capsys, "reward.functions[0].weight=0.5")["reward"]
    assert reward["functions"] == [{"name": "math_answer", "weight": 0.5, "kwargs": {}}]
    functions = load_config(None, ["reward.functions.0.weight=0.25"]).reward.functions  # the default list
    assert functions[0].name == "math_answer" and functions[0].weight == 0.25
    config = load_config(QUICKSTART, ["reward.functions=[{name: exact_match}, {name: math_answer}]",
                                      "reward.functions[1].kwargs={timeout_s: 2}", "reward.functions[0]={name: x.y}"])
    assert [(f.name, f.kwargs) for f in config.reward.functions] == [("x.y", {}), ("math_answer", {"timeout_s": 2})]


@pytest.mark.parametrize("override, message", [
    ("reward.functions[1].weight=0.5",
     "override reward.functions[1].weight: index 1 is out of range: reward.functions has 1 item"),
    ("reward.functions.3.weight=0.5",
     "override reward.functions.3.weight: index 3 is out of range: reward.functions has 1 item"),
    ("model[0].path=tiny", "override model[0].path: model is a section, not a list"),
    ("train.steps[0]=3", "override train.steps[0]: 'steps' is a value, not a list"),
    ("reward.functions[0][1]=3", "override reward.functions[0][1]: reward.functions[0] is a section, not a list"),
    ("reward.functions.weight=1", "override reward.functions.weight: reward.functions is a list; index it by "
                                  "position, e.g. reward.functions[0]"),
    ("reward.functions[-1].weight=1", "override reward.functions[-1].weight: [-1] is not a list index"),
])
def test_a_bad_index_is_one_line(capsys, override, message):
    assert main(["train", QUICKSTART, override, "--print-config"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"rollflow: error: {message}") and err.count("\n") == 1, err
