"""A table of malformed inputs: each gives exit status 2 and one line that names the problem, never a
traceback, never a run that starts anyway.

Config values and YAML files go through the real command line, `rollflow train CONFIG ... --print-plan`,
which validates and plans without starting a worker. Models and datasets go through the driver's checks
before Ray starts (`rollflow.inputs.prompt_sets.load_prompt_sets`), their error printed as the CLI prints any
`RollflowError`. docs/failures.md lists every case with the message it gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollflow.cli import EXIT_USER_ERROR, main
from rollflow.config import load_config
from rollflow.errors import RollflowError
from rollflow.inputs.prompt_sets import load_prompt_sets
from rollflow.pipelines.rlvr import rlvr_roles
from rollflow.rewards.registry import REWARD_FUNCTIONS, needs_columns, required_columns

QUICKSTART = "examples/quickstart.yaml"


@dataclass
class Case:
    """One malformed input.

    Attributes:
        category: the docs/failures.md category.
        input: the input, as docs/failures.md shows it.
        expected: words the one error line must contain (`DIR`: the test's directory).
        overrides: `key=value` overrides (may contain `{tmp}`, the test's directory).
        config: the config file's text or bytes; None: examples/quickstart.yaml.
        files: extra files to write, path under the test directory -> text or bytes.
        hub: for a hub id: `"unreachable"` (no network) or `"offline"` (HF_HUB_OFFLINE set).
        config_path: the config file when `config` is None (examples/quickstart.yaml by default).
    """

    category: str
    input: str
    expected: str
    overrides: list[str] = field(default_factory=list)
    config: str | bytes | None = None
    files: dict[str, str | bytes] = field(default_factory=dict)
    hub: str | None = None
    config_path: str = QUICKSTART


def _jsonl(*rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _dataset(content: str | bytes, *extra: str) -> dict:
    """A preflight case's keyword arguments: `content` as data.train, no eval set."""
    return {"files": {"d.jsonl": content},
            "overrides": ["data.train={path: '{tmp}/d.jsonl'}", "data.eval=null", *extra]}


@needs_columns("answer")
def graded_answer(completion: str, **row) -> float:
    """A user reward that declares the column it reads (used by the missing-column case)."""
    return float(completion.strip() == str(row["answer"]))


def _safetensors(data_bytes: int, header: dict | None = None) -> bytes:
    """A safetensors file: its header (`header`, default none of tensors), then `data_bytes` zero bytes."""
    text = json.dumps(header or {}).encode()
    return len(text).to_bytes(8, "little") + text + bytes(data_bytes)


# A header describing one float32 tensor of 25 values (100 bytes of data) over 40 bytes: a copy cut short.
TRUNCATED_SAFETENSORS = _safetensors(40, {"w": {"dtype": "F32", "shape": [25], "data_offsets": [0, 100]}})
MODEL_FILES = {"m/config.json": json.dumps({"model_type": "qwen2"}), "m/model.safetensors": _safetensors(0),
               "m/tokenizer.json": "{}"}

MULTI_DOMAIN = "examples/multi_domain.yaml"
TWO_DOMAINS = "data.domains={add2: {train: {task: add2}}, sum3: {train: {task: sum3}}}"

# Rejected when the config loads: `rollflow train CONFIG ... --print-plan`.
CONFIG_CASES = [
    Case("seed", "`seed=-1`", "seed: must be in [0, 2**64)", ["seed=-1"]),
    Case("seed", "`seed=2**64`", "seed: must be in [0, 2**64)", [f"seed={2**64}"]),
    Case("seed", "`seed=10**30`", "torch's random generators take a 64-bit seed", [f"seed={10**30}"]),
    Case("seed", "`seed=1.5`", "seed: must be an integer in [0, 2**64)", ["seed=1.5"]),
    Case("seed", "`seed=true`", "seed: must be an integer", ["seed=true"]),
    Case("number", "`train.lr=.nan`", "train.lr is nan: every number in the config must be finite",
         ["train.lr=.nan"]),
    Case("number", "`train.lr=.inf`", "train.lr is inf", ["train.lr=.inf"]),
    Case("number", "`train.lr='nan'` (a string)", "train.lr: Input should be a finite number", ["train.lr='nan'"]),
    Case("number", "`rollout.temperature=-.inf`", "rollout.temperature is -inf", ["rollout.temperature=-.inf"]),
    Case("number", "`algorithm.policy_loss_kwargs={clip_low: .nan}`",
         "algorithm.policy_loss_kwargs.clip_low is nan", ["algorithm.policy_loss_kwargs={clip_low: .nan}"]),
    Case("number", "`roles.actor_train.lora={alpha: .inf}`", "roles.actor_train.lora.alpha is inf",
         ["roles.actor_train.lora={alpha: .inf}"]),
    Case("number", "`train.steps=true`", "train.steps: expected a number, not true / false", ["train.steps=true"]),
    Case("number", "`train.betas=[0.9, 1.0]`", "train.betas: AdamW betas must each be in [0, 1)",
         ["train.betas=[0.9, 1.0]"]),
    Case("number", "`train.betas=[-0.1, 0.999]`", "AdamW betas must each be in [0, 1)",
         ["train.betas=[-0.1, 0.999]"]),
    Case("number", "`eval.max_new_tokens=0`", "eval.max_new_tokens: Input should be greater than 0",
         ["eval.max_new_tokens=0"]),
    Case("reward", "`weight: .inf`", "reward.functions.0.weight is inf",
         ["reward.functions=[{name: math_answer, weight: .inf}]"]),
    Case("reward", "the same reward twice", "each reward may appear once",
         ["reward.functions=[{name: math_answer}, {name: math_answer, weight: 0.5}]"]),
    Case("reward", "`reward.functions=[]`", "a run needs at least one reward function", ["reward.functions=[]"]),
    Case("model", "`model.dtype=float16` with `cluster.device: cpu`",
         "half precision on CPU turns the weights NaN; use float32 or "
         "bfloat16", ["model.dtype=float16"]),
    Case("algorithm", "`grpo` with `rollout.group_size=1`", "every advantage would be 0",
         ["rollout.group_size=1"]),
    Case("algorithm", "`rloo` with `rollout.group_size=1`", "set rollout.group_size >= 2",
         ["algorithm.advantage=rloo", "rollout.group_size=1"]),
    Case("algorithm", "`reinforce_pp` with `{group_baseline: true}` and `rollout.group_size=1`",
         "with group_baseline",
         ["algorithm.advantage=reinforce_pp", "algorithm.advantage_kwargs={group_baseline: true}",
          "rollout.group_size=1"]),
    Case("run name", "`name=a/b`", "name: must not contain '/' or '\\'", ["name=a/b"]),
    Case("run name", "`name=/tmp/run` (absolute)", "must not contain '/'", ["name=/tmp/run"]),
    Case("run name", "`name=a\\b`", "must not contain '/' or '\\'", ["name=a\\b"]),
    Case("run name", "`name=..`", "name: must not be '..'", ["name=.."]),
    Case("run name", "`name=.`", "name: must not be '.'", ["name=."]),
    Case("run name", "`name=''` (empty)", "name: must not be empty", ["name=''"]),
    Case("run name", "a name with NUL", "must not contain control characters ('\\x00')", ['name="a\\0b"']),
    Case("run name", "a name with a newline", "must not contain control characters ('\\n')", ['name="a\\nb"']),
    Case("run name", "a name of 101 characters", "has 101 characters, more than 100", ["name=" + "x" * 101]),
    Case("output", "`output.dir` with NUL", "output.dir: must not contain control characters",
         ['output.dir="a\\0"']),
    Case("YAML", "`train:` given twice", "key 'train' appears twice in one mapping (lines 1 and 4)",
         config="train:\n  steps: 5\nname: twice\ntrain:\n  lr: 1.0e-4\n"),
    Case("YAML", "`train: {steps: 5, steps: 6}`", "key 'steps' appears twice",
         config="train: {steps: 5, steps: 6}\n"),
    Case("YAML", "`train={steps: 1, steps: 2}` (an override)",
         "override 'train={steps: 1, steps: 2}': key 'steps' appears "
         "twice", ["train={steps: 1, steps: 2}"]),
    Case("YAML", "a list where a section belongs", "train: Input should be a valid dictionary",
         config="train: [1, 2]\n"),
    Case("YAML", "a null section (`train:` with nothing under it)", "train: Input should be a valid dictionary",
         config="train:\nname: x\n"),
    Case("YAML", "a scalar file", "must hold a mapping of keys, not str", config="just some text\n"),
    Case("YAML", "a list file", "must hold a mapping of keys, not list", config="- train\n- steps\n"),
    Case("YAML", "an empty file", "is empty; write at least the keys you change", config=""),
    Case("YAML", "a file of comments", "is empty", config="# nothing here\n"),
    Case("YAML", "tab indentation", "is not valid YAML", config="train:\n\tsteps: 5\n"),
    Case("YAML", "a binary file", "is not UTF-8 text (byte 0x89", config=b"\x89PNG\r\n\x1a\n\x00\x00"),
    Case("YAML", "an unclosed bracket", "is not valid YAML", config="train: {steps: 5\n"),
    Case("YAML", "`train.steps.x=1` (an override into a value)",
         "override train.steps.x: 'steps' is a value, not a section",
         ["train.steps.x=1"]),
    Case("YAML", "`train.step=5` (an unknown key)", "unknown config key 'train.step'; did you mean 'train.steps'?",
         ["train.step=5"]),
    Case("domains", "`data.domains` and `data.eval` (quickstart.yaml sets it; its `train` is the default)",
         "data: set either `domains` or `train` / `eval`, not both (eval set too)", [TWO_DOMAINS]),
    Case("domains", "`data.eval.limit=8` with `data.domains` (multi_domain.yaml)",
         "not both (eval set too); each domain has its own `train` and `eval` under data.domains",
         ["data.eval.limit=8"], config_path=MULTI_DOMAIN),
    Case("domains", "`data.domains={}`", "data.domains: no domains: name at least one", ["data.domains={}"],
         config_path=MULTI_DOMAIN),
    Case("domains", "a domain named `a-b`", "data.domains: domain name 'a-b': a letter, then letters, digits or '_'",
         ["data.domains={a-b: {train: {task: add2}}}"], config_path=MULTI_DOMAIN),
    Case("domains", "a domain named `mean`", "domain name 'mean' is taken by a metric (reward/mean)",
         ["data.domains={mean: {train: {task: add2}}}"], config_path=MULTI_DOMAIN),
    Case("domains", "a domain without `train`", "data.domains.sum3.train: Field required",
         ["data.domains={add2: {train: {task: add2}}, sum3: {share: 2}}"], config_path=MULTI_DOMAIN),
    Case("domains", "`share: 0`", "data.domains.sum3.share: Input should be greater than 0",
         ["data.domains.sum3.share=0"], config_path=MULTI_DOMAIN),
    Case("domains", "a share too small for one prompt a step",
         "data.domains.sum3 gets 0.634 prompts per step (share 0.0099 of rollout.groups_per_step 64); every "
         "domain needs at least 1", ["data.domains.sum3.share=0.005"], config_path=MULTI_DOMAIN),
    Case("domains", "`reward.domains` naming no domain",
         "reward.domains names 'sum4', not a domain of data.domains (its domains: add2, sum3)",
         ["reward.domains={sum4: [{name: math_answer}]}"], config_path=MULTI_DOMAIN),
    Case("domains", "`reward.domains` without `data.domains`", "reward.domains gives domains their own rewards, "
         "but there are no domains", ["reward.domains={add2: [{name: math_answer}]}"]),
    Case("domains", "a domain's empty reward list",
         "reward.domains: domain 'sum3': a run needs at least one reward function",
         ["reward.domains={sum3: []}"], config_path=MULTI_DOMAIN),
    Case("algorithm", "`reward_norm_by_domain=true` without batch or running normalization",
         "algorithm: reward_norm_by_domain needs reward_norm_mean or reward_norm_std to be batch or running",
         ["algorithm.reward_norm_by_domain=true", "algorithm.reward_norm_mean=group"]),
]

# Rejected by the driver before Ray starts (`load_prompt_sets`): models, datasets, limits against the model.
PREFLIGHT_CASES = [
    Case("model", "a directory without weights", "has no weights (no *.safetensors, *.bin or their index files)",
         ["model.path={tmp}/m"], files={"m/config.json": "{}", "m/tokenizer.json": "{}"}),
    Case("model", "a directory without a tokenizer", "has no tokenizer (no tokenizer.json",
         ["model.path={tmp}/m"], files={"m/config.json": "{}", "m/model.safetensors": b""}),
    Case("model", "a directory without `config.json`", "is not a Hugging Face model directory (no config.json)",
         ["model.path={tmp}/m"], files={"m/model.safetensors": b""}),
    Case("model", "a path that does not exist", "does not exist", ["model.path={tmp}/nothing/here"]),
    Case("model", "a hub id, not cached, no network", "the hub (huggingface.co) cannot be reached",
         ["model.path=nobody/no-such-model"], hub="unreachable"),
    Case("model", "a hub id, not cached, `HF_HUB_OFFLINE=1`", "and HF_HUB_OFFLINE is set",
         ["model.path=nobody/no-such-model"], hub="offline"),
    Case("model", "`model.path='a b'`", "is neither a local directory nor a valid hub id", ["model.path='a b'"],
         hub="unreachable"),
    Case("model", "`model.path` with NUL", "contains a NUL character", ['model.path="ti\\0ny"']),
    Case("model", "an unreadable `config.json`", "cannot read the model config", ["model.path={tmp}/m"],
         files={**MODEL_FILES, "m/config.json": "{not json"}),
    Case("model", "a safetensors file cut short (an interrupted copy or download)",
         "model file DIR/m/model.safetensors is cut short: it has 112 bytes, its header describes 172; copy or "
         "download it again", ["model.path={tmp}/m"],
         files={**MODEL_FILES, "m/model.safetensors": TRUNCATED_SAFETENSORS}),
    Case("limits", "`rollout.max_new_tokens=256` (the tiny model's context)",
         "rollout.max_new_tokens is 256, but the model's context holds 256 tokens",
         ["rollout.max_new_tokens=256", "data.eval=null"]),
    Case("limits", "`eval.max_new_tokens=300`", "eval.max_new_tokens is 300", ["eval.max_new_tokens=300"]),
    Case("data", "a null prompt", "row 2: the prompt (column 'prompt') is null",
         **_dataset(_jsonl({"prompt": "1+1", "answer": "2"}, {"prompt": None, "answer": "3"}))),
    Case("data", "an empty prompt", "row 1: the prompt (column 'prompt') is empty",
         **_dataset(_jsonl({"prompt": "", "answer": "2"}))),
    Case("data", "a number as the prompt", "must be a string, not int",
         **_dataset(_jsonl({"prompt": 12, "answer": "2"}))),
    Case("data", "a prompt over the model's context (with `rollout.max_new_tokens`)",
         "over the model's context of 256 tokens",
         **_dataset(_jsonl({"prompt": "1" * 250, "answer": "2"}), "data.max_prompt_tokens=300")),
    Case("data", "a prompt over `data.max_prompt_tokens`", "over data.max_prompt_tokens=10",
         **_dataset(_jsonl({"prompt": "1" * 20, "answer": "2"}), "data.max_prompt_tokens=10")),
    Case("data", "a binary file", "d.jsonl:1: not UTF-8 text (byte 0x89)", **_dataset(b"\x89PNG\r\n\x1a\n\x00")),
    Case("data", "an empty file", "has no rows", **_dataset("")),
    Case("data", "an invalid JSON line", "d.jsonl:2: not valid JSON",
         **_dataset('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2",\n')),
    Case("data", "a JSON array line", "d.jsonl:1: each line must be a JSON object", **_dataset("[1, 2]\n")),
    Case("data", "no `prompt` column", "has no 'prompt' column", **_dataset(_jsonl({"question": "1+1"}))),
    Case("data", "a dataset file that does not exist", "dataset file not found",
         ["data.train={path: '{tmp}/none.jsonl'}", "data.eval=null"]),
    Case("data", "a user reward's declared column missing",
         "reward 'tests.config.test_malformed_inputs:graded_answer' needs the column 'answer'",
         **_dataset(_jsonl({"prompt": "1+1"}),
                    "reward.functions=[{name: 'tests.config.test_malformed_inputs:graded_answer'}]")),
    Case("data", "`math_answer` without an `answer` column", "reward 'math_answer' needs the column 'answer'",
         **_dataset(_jsonl({"prompt": "1+1", "solution": "2"}))),
    Case("domains", "a domain's own reward's declared column missing",
         "data.domains.sum3.train (DIR/d.jsonl) row 1: reward 'tests.config.test_malformed_inputs:graded_answer' "
         "needs the column 'answer'",
         files={"d.jsonl": _jsonl({"prompt": "1+1+1"})},
         overrides=["data.domains.sum3.train={path: '{tmp}/d.jsonl'}", "data.domains.sum3.eval=null",
                    "reward.functions=[{name: length_penalty}]",
                    "reward.domains={sum3: [{name: 'tests.config.test_malformed_inputs:graded_answer'}]}"],
         config_path=MULTI_DOMAIN),
    Case("domains", "a bad row of a domain's eval set", "data.domains.add2.eval (DIR/d.jsonl) row 1: the prompt "
         "(column 'prompt') is empty", files={"d.jsonl": _jsonl({"prompt": "", "answer": "2"})},
         overrides=["data.domains.add2.eval={path: '{tmp}/d.jsonl'}"], config_path=MULTI_DOMAIN),
]


def _materialize(case: Case, tmp_path: Path) -> list[str]:
    """Write the case's files; return its overrides with `{tmp}` filled in."""
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return [item.replace("{tmp}", str(tmp_path)) for item in case.overrides]


def cli_error(case: Case, tmp_path: Path, capsys) -> tuple[int, str]:
    """Run `rollflow train CONFIG *overrides --print-plan`; return (exit status, stderr)."""
    overrides = _materialize(case, tmp_path)
    config = case.config_path
    if case.config is not None:
        config = str(tmp_path / "config.yaml")
        Path(config).write_bytes(case.config if isinstance(case.config, bytes) else case.config.encode())
    code = main(["train", config, f"output.dir={tmp_path / 'runs'}", *overrides, "--print-plan"])
    return code, capsys.readouterr().err


def preflight_error(case: Case, tmp_path: Path, monkeypatch) -> tuple[int, str]:
    """Load the config and run the driver's checks; return (exit status, stderr) as the CLI gives them."""
    from huggingface_hub import constants

    overrides = _materialize(case, tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # nothing cached
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", case.hub == "offline")
    monkeypatch.setattr("rollflow.models._reachable", lambda host, port, timeout_s: False)  # never the network
    try:
        config = load_config(case.config_path, [f"output.dir={tmp_path / 'runs'}", *overrides])
        load_prompt_sets(config, rlvr_roles(config))
    except RollflowError as err:
        return getattr(err, "exit_code", EXIT_USER_ERROR), f"rollflow: error: {err}\n"
    return 0, ""


def _assert_one_line(code: int, stderr: str, expected: str) -> None:
    assert code == EXIT_USER_ERROR, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("rollflow: error: ")
    assert expected in lines[0], lines[0]


def _id(case: Case) -> str:
    return f"{case.category}: {case.input}"


def test_the_table_is_large_enough():
    assert len(CONFIG_CASES) + len(PREFLIGHT_CASES) >= 45


@pytest.mark.parametrize("case", CONFIG_CASES, ids=_id)
def test_malformed_config(case, tmp_path, capsys):
    _assert_one_line(*cli_error(case, tmp_path, capsys), case.expected.replace("DIR", str(tmp_path)))


@pytest.mark.parametrize("case", PREFLIGHT_CASES, ids=_id)
def test_malformed_model_or_data(case, tmp_path, monkeypatch):
    if "math_answer" in case.expected and not required_columns(REWARD_FUNCTIONS["math_answer"]):
        pytest.skip("rollflow/rewards/math.py: math_answer lacks @needs_columns('answer')")
    _assert_one_line(*preflight_error(case, tmp_path, monkeypatch), case.expected.replace("DIR", str(tmp_path)))


def test_a_good_dataset_passes_every_check(tmp_path, monkeypatch):
    """The checks refuse what is wrong, not what is merely unusual: spaces, a chat-message prompt, extras."""
    good = Case("data", "good rows", "", **_dataset(_jsonl(
        {"prompt": "1 + 1", "answer": "2", "level": 1},
        {"prompt": [{"role": "user", "content": "2+2"}], "answer": 4})))
    assert preflight_error(good, tmp_path, monkeypatch) == (0, "")
    tiny = Path("rollflow/assets/tiny-qwen2-add")
    files = {f"m/{name}": (tiny / name).read_text() for name in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    model = Case("model", "a complete directory", "", ["model.path={tmp}/m", "data.eval=null"],
                 files={**MODEL_FILES, **files})
    assert preflight_error(model, tmp_path, monkeypatch) == (0, "")


def test_a_cached_hub_id_needs_no_network(tmp_path, monkeypatch):
    """A hub id in the local cache passes the model check with the hub unreachable."""
    from huggingface_hub import constants

    from rollflow.models import check_model_files

    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("rollflow.models._reachable", lambda host, port, timeout_s: False)
    assert check_model_files("org/cached") == "org/cached"
