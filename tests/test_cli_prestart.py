"""When `rollflow train` / `eval` start a local Ray ahead of loading the config (`cli._prestart_ray`): for a
plainly local Ray in a fresh process, with the `num_cpus` the file and overrides give; never for a cluster
address, a resume, a value the loader would reject, or a process that imported torch already."""

import sys

import pytest

from rollflow import cli


@pytest.fixture
def prestarts(monkeypatch):
    """The `num_cpus` of each prestart `_prestart_ray` asks for, in a process that looks fresh (no torch)."""
    asked = []
    monkeypatch.setattr("rollflow.cluster.runtime.prestart_ray", asked.append)
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
    asked = []
    monkeypatch.setattr("rollflow.cluster.runtime.prestart_ray", asked.append)
    assert "torch" in sys.modules  # a test process, a notebook: nothing left to overlap
    cli._prestart_ray(_config(tmp_path, "name: a\n"), [])
    assert asked == []
