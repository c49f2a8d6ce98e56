"""Load-time rules on config values and YAML files: each mistake is one `ConfigError` line, never a run."""

import pytest
import torch

from rollflow.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs
from rollflow.config import load_config
from rollflow.config.rlvr import GROUP_ESTIMATORS
from rollflow.errors import ConfigError


def _error(overrides: list[str], path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- YAML files ---------------------------------------------------------------------------------------------


def test_a_key_given_twice_is_an_error_naming_the_key_and_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\nrollout:\n  max_new_tokens: 4\ntrain:\n  lr: 1.0e-4\n")
    message = _error([], path)
    assert "key 'train' appears twice in one mapping (lines 1 and 5)" in message and str(path) in message


def test_a_nested_key_given_twice_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("roles:\n  actor_train: {num_cpus: 1, num_cpus: 2}\n")
    assert "key 'num_cpus' appears twice" in _error([], path)


def test_a_merge_key_may_still_be_overridden(tmp_path):
    """`<<: *base` then an explicit key is how YAML merges work, not a duplicate."""
    path = tmp_path / "c.yaml"
    path.write_text("x-role: &role {num_cpus: 1, num_workers: 1}\n"
                    "roles:\n  actor_infer:\n    <<: *role\n    num_cpus: 2\n")
    tree_error = _error([], path)  # the anchor's own key is unknown to the schema, nothing else
    assert "unknown config key 'x-role'" in tree_error


def test_an_override_value_with_a_key_given_twice_is_an_error():
    assert "key 'steps' appears twice" in _error(["train={steps: 1, steps: 2}"])


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("hello\n", "must hold a mapping of keys, not str"),
    ("- 1\n- 2\n", "must hold a mapping of keys, not list"),
    ("train:\n\tsteps: 3\n",
     "found character '\\t' that cannot start any token (line 2, column 1); indent with spaces, not tabs"),
])
def test_files_that_hold_no_mapping(tmp_path, content, message):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    assert message in _error([], path)


def test_a_binary_file_is_not_utf8(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: \xff\xfe\x00run\n")
    assert "is not UTF-8 text (byte 0xff at offset 6)" in _error([], path)


def test_a_directory_is_not_a_config_file(tmp_path):
    assert "(it is a directory)" in _error([], tmp_path)


# --- seed ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1])
def test_seed_takes_every_64_bit_value(seed):
    assert load_config(None, [f"seed={seed}"]).seed == seed
    torch.Generator().manual_seed(seed)  # the range is exactly torch's


@pytest.mark.parametrize("value, message", [
    ("-1", "must be in [0, 2**64)"),
    (str(2**64), "must be in [0, 2**64)"),
    (str(10**30), "must be in [0, 2**64)"),
    ("1.5", "must be an integer"),
    ("true", "must be an integer"),
    ("'7'", "must be an integer"),
])
def test_seed_outside_the_range_or_not_an_integer(value, message):
    assert f"seed: {message}" in _error([f"seed={value}"])


# --- numbers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, where", [
    ("train.lr=.nan", "train.lr is nan"),
    ("train.lr=.inf", "train.lr is inf"),
    ("rollout.temperature=-.inf", "rollout.temperature is -inf"),
    ("reward.functions=[{name: math_answer, weight: .inf}]", "reward.functions.0.weight is inf"),
    ("algorithm.policy_loss_kwargs={clip_low: .nan}", "algorithm.policy_loss_kwargs.clip_low is nan"),
    ("roles.actor_train.lora={alpha: .inf}", "roles.actor_train.lora.alpha is inf"),
    ("train.betas=[0.9, .nan]", "train.betas.1 is nan"),
])
def test_non_finite_numbers_are_refused_everywhere(override, where):
    message = _error([override])
    assert where in message and "must be finite" in message


def test_a_non_finite_number_written_as_a_string_is_refused():
    assert "train.lr: Input should be a finite number" in _error(["train.lr='nan'"])


def test_every_float_the_examples_use_is_still_finite():
    for path in ("examples/quickstart.yaml", "examples/dapo.yaml", "examples/ppo_gae.yaml"):
        load_config(path)


@pytest.mark.parametrize("override", ["train.steps=true", "rollout.temperature=false", "eval.max_new_tokens=true"])
def test_a_boolean_is_not_a_number(override):
    assert "expected a number, not true / false" in _error([override])


@pytest.mark.parametrize("betas", ["[0.9, 1.0]", "[-0.1, 0.999]", "[1.5, 0.9]"])
def test_betas_are_each_in_zero_one(betas):
    assert "train.betas: AdamW betas must each be in [0, 1)" in _error([f"train.betas={betas}"])


def test_betas_at_zero_are_fine():
    assert load_config(None, ["train.betas=[0.0, 0.0]"]).train.betas == (0.0, 0.0)


def test_eval_max_new_tokens_is_positive_when_set():
    assert "eval.max_new_tokens: Input should be greater than 0" in _error(["eval.max_new_tokens=0"])
    assert load_config(None, ["eval.max_new_tokens=null"]).eval.max_new_tokens is None


# --- rewards, dtype, groups ---------------------------------------------------------------------------------


def test_reward_names_are_unique_and_there_is_at_least_one():
    functions = "[{name: math_answer}, {name: exact_match}, {name: math_answer, weight: 2}]"
    message = _error([f"reward.functions={functions}"])
    assert "each reward may appear once" in message and "repeated: math_answer" in message
    assert "at least one reward function" in _error(["reward.functions=[]"])


def test_float16_on_cpu_is_refused_with_the_reason():
    message = _error(["model.dtype=float16"])
    assert message == ("model.dtype float16 with cluster.device cpu: half precision on CPU turns the weights NaN; "
                       "use float32 or bfloat16")
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_a_group_estimator_needs_two_group_size(estimator):
    message = _error([f"algorithm.advantage={estimator}", "rollout.group_size=1"])
    assert f"algorithm.advantage {estimator!r}" in message and "every advantage would be 0" in message
    assert "rollout.group_size >= 2" in message and "reinforce_pp" in message


def test_reinforce_pp_with_a_group_baseline_needs_two_group_size():
    overrides = ["algorithm.advantage=reinforce_pp", "rollout.group_size=1"]
    assert load_config(None, overrides).rollout.group_size == 1  # no baseline: fine
    message = _error([*overrides, "algorithm.advantage_kwargs={group_baseline: true}"])
    assert "'reinforce_pp' with group_baseline" in message


def test_group_estimators_are_exactly_those_a_group_of_one_zeroes():
    """The config's list matches the estimators: with every sample alone in its group, exactly these give
    all-zero advantages (and the others do not)."""
    generator = torch.Generator().manual_seed(0)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 0.5, 2.0]), mask=torch.ones(4, 3), group_ids=torch.arange(4),
        values=torch.randn(4, 3, generator=generator), logprobs=torch.randn(4, 3, generator=generator),
        teacher_logprobs=torch.randn(4, 3, generator=generator))
    zeroed = {name for name in ADVANTAGE_ESTIMATORS
              if torch.all(ADVANTAGE_ESTIMATORS[name](inputs)[0] == 0)}
    assert zeroed == set(GROUP_ESTIMATORS)
    with_baseline = ADVANTAGE_ESTIMATORS["reinforce_pp"](inputs, group_baseline=True)[0]
    assert torch.all(with_baseline == 0)


# --- run name and output directory --------------------------------------------------------------------------


@pytest.mark.parametrize("name, message", [
    ("a/b", "must not contain '/' or '\\'"),
    ("/abs/run", "must not contain '/' or '\\'"),
    ("a\\b", "must not contain '/' or '\\'"),
    (".", "must not be '.'"),
    ("..", "must not be '..'"),
    ("''", "must not be empty"),
    ("'   '", "must not be empty"),
    ('"a\\0b"', "must not contain control characters ('\\x00')"),
    ('"a\\nb"', "must not contain control characters ('\\n')"),
    ("x" * 101, "has 101 characters, more than 100"),
])
def test_run_name_is_a_plain_name(name, message):
    line = _error([f"name={name}"])
    assert line.startswith("name: ") and message in line


@pytest.mark.parametrize("name", ["run", "grpo-7b_lr1e-5", "x" * 100, "ünïcode", "a.b"])
def test_plain_names_are_fine(name):
    assert load_config(None, [f"name={name}"]).name == name


def test_output_dir_has_no_control_characters():
    assert "output.dir: must not contain control characters ('\\x00')" in _error(['output.dir="ru\\0ns"'])
    assert "output.dir: must not be empty" in _error(["output.dir=''"])
    assert load_config(None, ["output.dir=/tmp/my runs"]).output.dir == "/tmp/my runs"
