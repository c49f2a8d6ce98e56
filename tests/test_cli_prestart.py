"""When `rollflow train` / `eval` start a local Ray ahead of the pipeline (`cli._prestart_ray`): once the config
loaded (it loads without torch), for a plainly local Ray in a fresh process, with the config's `num_cpus`;
never for a cluster address, a resume, or a process that imported torch already; and never for a config the
loader refuses, whose one error line comes first."""

import subprocess
import sys
import time

import pytest

from rollflow import cli
from rollflow.config import load_config
from rollflow.workers import warm


class _Asked(list):
    """The `num_cpus` of each prestart asked for; `models`: the model each one's warm worker was told."""

    def __init__(self):
        super().__init__()
        self.models = []

    def __call__(self, num_cpus, warm_up=None, warm_up_env=None):
        assert warm_up == warm.SETUP_HOOK
        self.append(num_cpus)
        self.models.append((warm_up_env or {}).get(warm.MODEL_VARIABLE))


@pytest.fixture
def prestarts(monkeypatch):
    """The `num_cpus` of each prestart `_prestart_ray` asks for, in a process that looks fresh (no torch)."""
    asked = _Asked()
    monkeypatch.setattr("rollflow.cluster.prestart.prestart_ray", asked)
    monkeypatch.delitem(sys.modules, "torch")
    return asked


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, overrides, expected", [
    ("name: a\n", [], [None]),
    ("cluster: {num_cpus: 4}\n", [], [4]),
    ("cluster: {num_cpus: 4}\n", ["cluster.num_cpus=2"], [2]),
    ("name: a\n", ["cluster={num_cpus: 2}"], [2]),
    ("cluster:\n  address: 10.0.0.1:6379\n", [], []),  # joining a cluster: the pipeline does
    ("name: a\n", ["cluster.address=10.0.0.1:6379"], []),
    ("resume: true\n", [], []),  # a finished run must stop at once
    ("name: a\n", ["resume=true"], []),
])
def test_which_configs_prestart_ray(tmp_path, prestarts, text, overrides, expected):
    cli._prestart_ray(load_config(_config(tmp_path, text), overrides))
    assert prestarts == expected


def test_a_process_with_torch_prestarts_nothing(tmp_path, monkeypatch):
    asked = _Asked()
    monkeypatch.setattr("rollflow.cluster.prestart.prestart_ray", asked)
    assert "torch" in sys.modules  # a test process, a notebook: nothing left to overlap
    cli._prestart_ray(load_config(_config(tmp_path, "name: a\n")))
    assert asked == []


def test_the_warm_worker_is_told_the_config_s_model(tmp_path, prestarts):
    cli._prestart_ray(load_config(_config(tmp_path, "model: {path: /models/a}\n")))
    cli._prestart_ray(load_config(_config(tmp_path, "model: {path: /models/a}\n"), ["model.path=/models/b"]))
    cli._prestart_ray(load_config(None, ["name=a"]))
    assert prestarts.models == ["/models/a", "/models/b", "tiny"]


FRESH = """
import sys
from rollflow.cluster import prestart

def prestart_ray(num_cpus, warm_up=None, warm_up_env=None):
    print("PRESTART", num_cpus, "torch" in sys.modules, flush=True)

def take_prestarted_ray(num_cpus):
    print("TAKE", num_cpus, "torch" in sys.modules, flush=True)
    raise SystemExit(0)

prestart.prestart_ray = prestart_ray
prestart.take_prestarted_ray = take_prestarted_ray
from rollflow.cli import main
code = main(sys.argv[1:])
print("TORCH", "torch" in sys.modules, flush=True)
sys.exit(code)
"""


@pytest.mark.parametrize("argv", [["train", "CONFIG"], ["sft", "CONFIG"], ["eval", "--model", "tiny"]])
def test_a_config_error_is_one_line_before_ray_and_without_torch(tmp_path, argv):
    """From a fresh process, as a user runs it: a config the loader refuses ends in its one error line, with
    nothing of Ray before it (no prestart, no "starting Ray ..."), and torch never imported. (Its time is
    printed, not asserted: ~1 s here, 0.5 CPU-s of Python, pydantic and the config's models.)"""
    config = _config(tmp_path, "cluster: {num_cpus: 2}\n")
    argv = [config if a == "CONFIG" else a for a in argv] + ["rollout.max_new_tokns=6"]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", FRESH, *argv], capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == ["TORCH False"]  # no PRESTART, no "starting Ray ...", no TAKE
    (line,) = done.stderr.splitlines()
    assert line.startswith("rollflow: error: ") and "unknown config key 'rollout" in line, done.stderr
    print(f"{argv[0]}: the config error in {seconds:.2f} s")


def test_a_valid_config_prestarts_ray_before_torch_is_imported(tmp_path):
    config = _config(tmp_path, "cluster: {num_cpus: 2}\n")
    done = subprocess.run([sys.executable, "-c", FRESH, "train", config], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "PRESTART 2 False"  # asked for before torch came in
    assert done.stdout.splitlines()[-1] == "TAKE 2 True"  # the pipeline then takes it over
