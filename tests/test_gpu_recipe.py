"""The GPU recipe `examples/gpu/grpo_qwen2.5_0.5b_gsm8k.yaml`, checked on a CPU machine without network: its
placement plan and resolved config come out of the real command line without downloading the model or the
dataset, importing vLLM or `datasets`, or seeing a GPU; and its reward scores GSM8K's answer column."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

RECIPE = "examples/gpu/grpo_qwen2.5_0.5b_gsm8k.yaml"
GPUS = set(range(8))
FLAGS = ("--print-plan", "--print-config")
# The command line's `main`, with vLLM and `datasets` made unimportable first: a print command that imported
# either (to build an engine, to read the hub dataset) fails instead of passing where they happen to be
# installed. One process runs `rollflow train RECIPE FLAG` for each flag (its start, torch's import, is paid
# once), each command's output after a line of its own.
ENTRY_POINT = ("import sys\n"
               "for name in ('vllm', 'datasets', 'sglang'):\n"
               "    sys.modules[name] = None\n"
               "from rollflow.cli import main\n"
               "for flag in sys.argv[2:]:\n"
               "    print('---', flag, flush=True)\n"
               "    if main(['train', sys.argv[1], flag]) != 0:\n"
               "        sys.exit(f'rollflow train {flag} failed')\n")


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, str]:
    """stdout of `rollflow train RECIPE FLAG` for each of FLAGS: offline, no GPU visible, an empty Hugging
    Face cache."""
    hf_home = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", ENTRY_POINT, RECIPE, *FLAGS], capture_output=True,
                            text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    written = sorted(path for path in hf_home.rglob("*") if path.is_file())  # no download, no cached lookup
    assert not written, f"{FLAGS} wrote to the Hugging Face cache: {written}"
    outputs = result.stdout.split("--- ")[1:]
    assert [output.split("\n", 1)[0] for output in outputs] == list(FLAGS), result.stdout
    return {flag: output.split("\n", 1)[1] for flag, output in zip(FLAGS, outputs)}


def test_print_plan_colocates_trainer_and_engines_on_gpus_0_to_7(printed):
    out = printed["--print-plan"]
    lines = out.splitlines()
    assert lines[0] == "cluster: 1 node(s) x 8 GPUs", out
    devices: dict[str, set[int]] = {}
    workers: dict[str, int] = {}
    for line in lines[2:]:  # role  worker  node  devices  threads
        parts = line.split()
        if len(parts) == 5 and parts[1].isdigit():
            role, _, node, device, _ = parts
            assert node == "0", line
            devices.setdefault(role, set()).add(int(device))
            workers[role] = workers.get(role, 0) + 1
    assert devices == {"actor_train": GPUS, "actor_infer": GPUS, "reference": GPUS}, out
    assert workers == {"actor_train": 8, "actor_infer": 8, "reference": 8}, out  # one GPU per worker
    colocated = next(line for line in lines if line.startswith("colocated"))
    assert {"actor_train", "actor_infer", "reference"} <= set(colocated.replace("+", " ").split()), out
    assert "disaggregated (may run concurrently): none" in out


def test_print_config_is_the_vllm_fsdp2_gsm8k_run(printed):
    config = yaml.safe_load(printed["--print-config"])
    roles, data, algorithm = config["roles"], config["data"], config["algorithm"]
    assert config["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert roles["actor_infer"]["engine"] == "vllm" and roles["actor_infer"]["hybrid"] is False
    assert roles["actor_infer"]["engine_kwargs"]["tensor_parallel_size"] == 1
    assert roles["actor_train"]["backend"] == "fsdp2"
    assert roles["actor_train"]["backend_kwargs"]["mixed_precision"]["param_dtype"] == "bfloat16"
    assert set(roles["actor_train"]["device_mapping"]) == set(roles["actor_infer"]["device_mapping"]) == GPUS
    assert config["cluster"]["device"] == "gpu" and config["cluster"]["num_devices"] == 8
    assert data["train"] == {"task": None, "path": "openai/gsm8k", "subset": "main", "split": "train",
                             "limit": None}
    assert data["eval"]["path"] == "openai/gsm8k" and data["eval"]["split"] == "test"
    assert (data["prompt_key"], data["answer_key"]) == ("question", "answer")
    assert [function["name"] for function in config["reward"]["functions"]] == ["math_answer"]
    assert (algorithm["advantage"], algorithm["kl_estimator"], algorithm["kl_loss_coef"]) == ("grpo", "k3", 0.001)
    assert config["train"]["lr"] == pytest.approx(1e-6)
    rollout = config["rollout"]
    assert (rollout["groups_per_step"], rollout["group_size"], rollout["max_new_tokens"]) == (64, 8, 1024)


@pytest.mark.parametrize("completion, expected", [
    ("She sold 48 + 24 = 72 clips, so the answer is \\boxed{72}.", 1.0),
    ("She sold \\boxed{24} clips.", 0.0),
    ("48 + 24 = 72 clips altogether.", 1.0),  # no \boxed: math-verify takes the last number
])
def test_math_answer_reads_the_reference_from_a_gsm8k_solution(completion, expected):
    """GSM8K's `answer` column is a worked solution ending in `#### N`; the recipe maps it to `answer` as is."""
    from rollflow.rewards.math import math_answer

    solution = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
    assert math_answer(completion, answer=solution) == expected
