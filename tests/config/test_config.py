from fractions import Fraction
from pathlib import Path

import pytest

from rollflow.config import RLVRConfig, apply_overrides, dump_config, load_config
from rollflow.errors import ConfigError


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path):
    config = load_config(None)
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_overrides_are_parsed_as_yaml_values():
    config = load_config(None, ["rollout.groups_per_step=4", "train.lr=3e-5", "data.shuffle=false",
                                "reward.functions=[{name: exact_match, weight: 2}]", "cluster.address=null"])
    assert config.rollout.groups_per_step == 4
    assert config.train.lr == pytest.approx(3e-5)
    assert config.data.shuffle is False
    assert config.reward.functions[0].name == "exact_match" and config.reward.functions[0].weight == 2.0
    assert config.cluster.address is None


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["rollout.groups_per_step"])


@pytest.mark.parametrize("override, expected", [
    ("rollout.prompt_per_step=4", "did you mean 'rollout.groups_per_step'"),
    ("roles.actor_train.backnd=x", "did you mean 'roles.actor_train.backend'"),
    ("traing.steps=3", "did you mean 'train'"),
])
def test_unknown_key_names_the_nearest_valid_one(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_wrong_type_names_the_key_and_value():
    with pytest.raises(ConfigError, match=r"train\.lr: .*'abc'"):
        load_config(None, ["train.lr=abc"])


def test_indivisible_batch_sizes_say_what_to_change():
    with pytest.raises(ConfigError, match="train_micro_batch_size"):
        load_config(None, ["rollout.groups_per_step=3", "rollout.group_size=8",
                           "train.train_micro_batch_size=16"])
    with pytest.raises(ConfigError, match="optimizer_steps_per_step"):
        load_config(None, ["rollout.groups_per_step=3", "rollout.group_size=3",
                           "train.optimizer_steps_per_step=2"])


def test_unknown_algorithm_name_lists_valid_names():
    with pytest.raises(ConfigError, match="Did you mean 'grpo'.*Valid: .*rloo"):
        load_config(None, ["algorithm.advantage=grpoo"])


def test_unknown_algorithm_option_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'clip_high'"):
        load_config(None, ["algorithm.policy_loss_kwargs={clip_hi: 0.3}"])


def test_dataset_needs_exactly_one_source():
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(None, ["data.train={task: add2, path: x.jsonl}"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listed)


def test_samples_per_step_is_derived():
    config = RLVRConfig()
    assert config.rollout.samples_per_step == config.rollout.groups_per_step * config.rollout.group_size


def test_override_inside_a_default_section_keeps_the_other_defaults(tmp_path):
    config = load_config(None, ["data.eval.limit=20"])
    assert config.data.eval.task == "add2" and config.data.eval.split == "eval" and config.data.eval.limit == 20
    # a section the YAML file sets is taken as written (not merged with defaults)
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train: {path: data.jsonl}\n")
    assert load_config(path).data.train.task is None


def test_an_override_of_a_section_the_file_lacks_sets_only_its_key(tmp_path):
    """The rest of the section takes its defaults without counting as set: validators that ask what the config
    set see the override alone."""
    # `train.epochs` beside `train.steps` is refused only when both are set
    assert load_config(None, ["pipeline=sft", "data.train={task: add2}", "train.epochs=2"]).train.epochs == 2
    # asynchronous training turns TIS on unless the config sets train_infer_correction: an algorithm key of
    # another name does not set it (it did, off, for agentic runs and files without an algorithm section)
    path = tmp_path / "agentic.yaml"
    path.write_text("pipeline: agentic\n")
    asynchronous = ["rollout.max_staleness=1", "roles.actor_train.device_mapping=[0]",
                    "roles.actor_infer.device_mapping=[1]", "algorithm.entropy_coef=0.01"]
    assert load_config(path, asynchronous).algorithm.train_infer_correction is not None
    assert load_config(None, asynchronous).algorithm.train_infer_correction is not None
    assert load_config(path, [*asynchronous, "algorithm.train_infer_correction=null"]).algorithm.train_infer_correction \
        is None


def test_weight_checksum_off_survives_yaml(tmp_path):
    """YAML reads a bare `off` as false; the checksum mode still means "off"."""
    path = tmp_path / "c.yaml"
    path.write_text("checks:\n  weight_checksum: off\n")
    assert load_config(path).checks.weight_checksum == "off"
    assert load_config(None, ["checks.weight_checksum=off"]).checks.weight_checksum == "off"
    with pytest.raises(ConfigError, match="weight_checksum"):
        load_config(None, ["checks.weight_checksum=on"])


def test_domains_replace_train_and_eval_and_round_trip_through_yaml(tmp_path):
    config = load_config("examples/multi_domain.yaml")
    data = config.data
    assert data.train is None and data.eval is None  # each domain has its own
    assert list(data.domains) == ["add2", "sum3"]
    assert data.domains["sum3"].eval.task == "sum3" and data.domains["sum3"].share == 0.5
    assert config.reward.functions_of("sum3") == config.reward.functions  # no domain has its own
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(config))  # `train: null, eval: null` next to the domains
    assert load_config(path) == config


def test_domain_shares_are_normalized_exactly():
    # shares 0.1, 0.2 and 0.7 are the decimals they are written as: 1/10, 2/10, 7/10 (their floats sum to
    # 1.0000000000000002, and 0.3 * 10 is not 3.0 in floats)
    config = load_config(None, ["data.domains={a: {train: {task: add2}, share: 0.1}, "
                                "b: {train: {task: add2}, share: 0.2}, c: {train: {task: sum3}, share: 0.7}}",
                                "rollout.groups_per_step=10", "train.train_micro_batch_size=80"])
    assert config.data.domain_shares() == {"a": Fraction(1, 10), "b": Fraction(1, 5), "c": Fraction(7, 10)}
    # relative shares: 1 and 3 -> 1/4 and 3/4; the default share is 1
    shares = load_config(None, ["data.domains={a: {train: {task: add2}}, b: {train: {task: sum3}, share: 3}}"])
    assert shares.data.domain_shares() == {"a": Fraction(1, 4), "b": Fraction(3, 4)}
    assert load_config(None).data.domain_shares() == {}


def test_an_override_of_the_domains_keeps_the_default_train_and_eval_out_of_the_way():
    # `data.domains=...` with no `data` section in the file fills `data` from the defaults, train and eval
    # included: left at their defaults they count as unset
    config = load_config(None, ["data.domains={x: {train: {task: sum3}}}"])
    assert config.data.train is None and list(config.data.domains) == ["x"]
    with pytest.raises(ConfigError, match=r"not both \(train set too\)"):
        load_config(None, ["data.domains={x: {train: {task: sum3}}}", "data.train.limit=5"])


def test_reward_domains_give_a_domain_its_own_functions():
    config = load_config("examples/multi_domain.yaml",
                         ["reward.domains={sum3: [{name: exact_match}, {name: length_penalty, weight: 0.1}]}"])
    assert [f.name for f in config.reward.functions_of("sum3")] == ["exact_match", "length_penalty"]
    assert [f.name for f in config.reward.functions_of("add2")] == ["math_answer"]
    assert [f.name for f in config.reward.functions_of(None)] == ["math_answer"]


def test_every_example_config_loads_against_its_pipeline():
    examples = sorted((Path(__file__).parents[2] / "examples").rglob("*.yaml"))
    pipelines = {load_config(path).pipeline for path in examples}  # validates each: keys, names, batch sizes
    assert {"rlvr", "sft", "dpo", "distill"} <= pipelines
