"""An RLVR run's console says its initial eval accuracy once: on the `step 0/N` line (issue #27: a second
`initial eval accuracy 0.354` line repeated it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollflow.config import load_config
from rollflow.pipelines.rlvr import run_rlvr

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def test_the_initial_eval_accuracy_is_printed_once(tmp_path, ray_session, capsys):
    config = load_config(QUICKSTART, [f"output.dir={tmp_path}", "name=once", "train.steps=1",
                                      "rollout.groups_per_step=4", "rollout.group_size=4",
                                      "data.eval.limit=16", "output.trackers=[console]"])
    final = run_rlvr(config, manage_ray=False)
    lines = capsys.readouterr().out.splitlines()
    accuracy = final["initial_eval/accuracy"]
    assert 0 < accuracy < 1  # a number no start-up line (the placement table's 0s and 2s) holds by chance
    value = re.compile(rf"(?<![\d.])({re.escape(f'{accuracy:.3f}')}|{re.escape(f'{accuracy:.3g}')})(?!\d)")
    before_training = lines[:next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))]
    mentions = [line for line in before_training if value.search(line)]
    assert mentions == [f"step 0/1  eval_acc {accuracy:.3g}"], mentions
