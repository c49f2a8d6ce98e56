"""`rollflow --version`."""

from __future__ import annotations

import pytest

import rollflow
from rollflow.cli import main


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"rollflow {rollflow.__version__}\n"
