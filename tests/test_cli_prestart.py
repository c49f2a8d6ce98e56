"""When `rollflow train` / `eval` start a local Ray ahead of loading the config (`cli._prestart_ray`): for a
plainly local Ray in a fresh process, with the `num_cpus` the file and overrides give; never for a cluster
address, a resume, a value the loader would reject, or a process that imported torch already."""

import subprocess
import sys

import pytest

from rollflow import cli
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
    ("cluster:\n  address: 10.0.0.1:6379\n", [], []),  # joining a cluster: the pipeline does
    ("name: a\n", ["cluster.address=10.0.0.1:6379"], []),
    ("resume: true\n", [], []),  # a finished run must stop at once
    ("name: a\n", ["resume=true"], []),
    ("cluster: {num_cpus: many}\n", [], []),  # the loader says what is wrong
    ("cluster: {num_cpus: 0}\n", [], []),
    ("name: a\n", ["cluster={num_cpus: 2}"], []),
    ("[not a mapping\n", [], []),
])
def test_which_configs_prestart_ray(tmp_path, prestarts, text, overrides, expected):
    cli._prestart_ray(_config(tmp_path, text), overrides)
    assert prestarts == expected


def test_no_config_file_prestarts_the_default(prestarts):
    cli._prestart_ray(None, ["model.path=tiny"])  # `rollflow eval` without --config
    assert prestarts == [None]


def test_a_missing_file_prestarts_nothing(tmp_path, prestarts):
    cli._prestart_ray(str(tmp_path / "missing.yaml"), [])
    assert prestarts == []


def test_a_process_with_torch_prestarts_nothing(tmp_path, monkeypatch):
    asked = _Asked()
    monkeypatch.setattr("rollflow.cluster.prestart.prestart_ray", asked)
    assert "torch" in sys.modules  # a test process, a notebook: nothing left to overlap
    cli._prestart_ray(_config(tmp_path, "name: a\n"), [])
    assert asked == []


def test_the_warm_worker_is_told_the_config_s_model(tmp_path, prestarts):
    cli._prestart_ray(_config(tmp_path, "model: {path: /models/a}\n"), [])
    cli._prestart_ray(_config(tmp_path, "model: {path: /models/a}\n"), ["model.path=/models/b"])
    cli._prestart_ray(_config(tmp_path, "name: a\n"), [])  # the default model: the worker's to resolve
    assert prestarts.models == ["/models/a", "/models/b", None]


FRESH = """
import sys
from rollflow.cluster import prestart

def prestart_ray(num_cpus, warm_up=None, warm_up_env=None):
    print("PRESTART", num_cpus, "torch" in sys.modules, flush=True)

def wait_for_prestarted_ray():
    print("WAIT", "torch" in sys.modules, flush=True)
    raise SystemExit(0)

prestart.prestart_ray = prestart_ray
prestart.wait_for_prestarted_ray = wait_for_prestarted_ray
from rollflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["train", "CONFIG"], ["sft", "CONFIG"], ["eval", "--model", "tiny"]])
def test_the_command_line_prestarts_before_it_imports_torch(tmp_path, argv):
    """From a fresh process, as a user runs it: the prestart is asked for before anything imports torch (the
    CLI's own imports of the config and pipelines did, so the prestart never happened). A config the loader
    refuses then ends in its one error line: nothing said of Ray before it, and no wait for the Ray started."""
    config = _config(tmp_path, "cluster: {num_cpus: 2}\n")
    argv = [config if a == "CONFIG" else a for a in argv] + ["rollout.max_new_tokns=6"]
    done = subprocess.run([sys.executable, "-c", FRESH, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    expected = "PRESTART None False" if argv[0] == "eval" else "PRESTART 2 False"
    assert done.stdout.splitlines() == [expected]  # no "starting Ray ...", no WAIT
    (line,) = done.stderr.splitlines()
    assert line.startswith("rollflow: error: ") and "unknown config key 'rollout" in line, done.stderr
