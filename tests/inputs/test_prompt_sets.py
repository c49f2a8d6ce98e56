"""`load_prompt_sets` and `build_sampler` of a multi-domain run (`data.domains`): each domain's rows carry its
name, are checked against its own rewards, and are sampled by share."""

from __future__ import annotations

import collections
import json

import pytest

from rollflow.config import load_config
from rollflow.data.prompts import DomainSampler, PromptSampler
from rollflow.errors import DataError
from rollflow.inputs.prompt_sets import build_sampler, configured_datasets, load_prompt_sets, reward_columns
from rollflow.pipelines.rlvr import rlvr_roles
from rollflow.rewards.registry import REWARD_FUNCTIONS, required_columns

MULTI_DOMAIN = "examples/multi_domain.yaml"


def _inputs(*overrides: str, path: str = MULTI_DOMAIN):
    config = load_config(path, list(overrides))
    return config, load_prompt_sets(config, rlvr_roles(config))


def test_each_domains_rows_carry_its_name_and_are_sampled_by_share():
    config, inputs = _inputs("data.domains.add2.share=3", "data.domains.sum3.share=1",
                             "data.domains.add2.train.limit=50", "data.domains.add2.eval.limit=20")
    sizes = {name: len(prompts) for name, prompts in inputs.train_prompts_by_domain.items()}
    assert sizes == {"add2": 50, "sum3": 800}
    assert len(inputs.train_prompts) == 850 and len(inputs.eval_prompts) == 20 + 200
    assert {p.row["domain"] for p in inputs.train_prompts_by_domain["sum3"]} == {"sum3"}
    assert [p.row["domain"] for p in inputs.eval_prompts] == ["add2"] * 20 + ["sum3"] * 200
    sampler = build_sampler(config, inputs)
    assert isinstance(sampler, DomainSampler) and sampler.batch_size == 64
    for _ in range(3):  # 3/4 and 1/4 of 64: 48 and 16, past the end of add2's 50 rows
        batch = sampler.next_batch()
        assert collections.Counter(p.row["domain"] for p in batch) == {"add2": 48, "sum3": 16}
    # resuming from a checkpoint's state continues exactly
    state = json.loads(json.dumps(sampler.state()))
    expected = [p.text for p in sampler.take(70)]
    resumed = build_sampler(config, inputs)
    resumed.load_state(state)
    assert [p.text for p in resumed.take(70)] == expected


def test_a_single_dataset_run_keeps_its_sampler_and_rows():
    config, inputs = _inputs("data.train.limit=30", "data.eval.limit=5", path="examples/quickstart.yaml")
    assert inputs.train_prompts_by_domain == {} and "domain" not in inputs.train_prompts[0].row
    sampler = build_sampler(config, inputs)
    assert isinstance(sampler, PromptSampler) and sampler.rows is inputs.train_prompts
    assert [name for name, *_ in configured_datasets(config.data)] == ["data.train", "data.eval"]


def test_each_domain_is_seeded_on_its_own():
    # the same rows in two domains are walked in two different orders
    config, inputs = _inputs("data.domains.sum3.train={task: add2}", "data.domains.sum3.eval=null")
    sampler = build_sampler(config, inputs)
    add2, sum3 = sampler.samplers["add2"].take(20), sampler.samplers["sum3"].take(20)
    assert [p.row["prompt"] for p in add2] != [p.row["prompt"] for p in sum3]


@pytest.mark.skipif(not required_columns(REWARD_FUNCTIONS["math_answer"]),
                    reason="math_answer declares no column")
def test_a_domains_rows_are_checked_against_its_own_rewards(tmp_path):
    rows = tmp_path / "rules.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1"}) + "\n")  # no answer: fine for length_penalty alone
    domains = [f"data.domains.sum3.train={{path: '{rows}'}}", "data.domains.sum3.eval=null"]
    config, inputs = _inputs(*domains, "reward.domains={sum3: [{name: length_penalty}]}")
    assert reward_columns(config, "sum3") == {"length_penalty": ()}
    assert reward_columns(config, "add2") == {"math_answer": ("answer",)}
    assert inputs.train_prompts_by_domain["sum3"][0].row == {"prompt": "1+1", "domain": "sum3"}
    with pytest.raises(DataError, match=r"data\.domains\.sum3\.train \(.*rules\.jsonl\) row 1: reward 'math_answer' "
                                        r"needs the column 'answer'"):
        _inputs(*domains)  # the default rewards need the answer
