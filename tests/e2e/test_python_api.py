"""docs/python_api.md as a notebook would run it, and Ray workers importing user modules from the driver's
working directory. Each test is a fresh Python process that starts its own Ray, as a user's would (a run that
manages Ray would stop a shared session's); they are the papercut fixes that need Ray.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "python_api.md"
PYTHON_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```$", re.DOTALL | re.MULTILINE)

# Run before the doc's code: every config it loads or builds gets these overrides last (1 step, small batches,
# a short eval, the run directories under the test's directory), so each run costs seconds.
SMOKE_PRELUDE = '''
import rollflow.config
import rollflow.config.loading as loading

SMOKE = {{
    "rlvr": ["rollout.groups_per_step=4", "rollout.group_size=4", "train.train_micro_batch_size=16"],
    "sft": ["train.batch_size=16", "train.train_micro_batch_size=16"],
}}
_build_config = loading.build_config


def smoke_build_config(tree):
    smoke = [*SMOKE[tree.get("pipeline", "rlvr")], "train.steps=1", "data.eval.limit=8",
             "output.trackers=[jsonl]", "output.dir={runs}"]
    return _build_config(loading.apply_overrides(tree, smoke))


loading.build_config = rollflow.config.build_config = smoke_build_config
'''


def _python_blocks(markdown: str) -> list[str]:
    return [textwrap.dedent(code) for _, code in PYTHON_BLOCK.findall(markdown)]


def _run(script: str, cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_python_block_of_the_python_api_doc_runs(tmp_path):
    blocks = _python_blocks(DOC.read_text())
    assert len(blocks) == 5, "a python block of docs/python_api.md was not found (or one was added: count it)"
    runs = tmp_path / "runs"
    result = _run(SMOKE_PRELUDE.format(runs=runs) + "\n\n".join(blocks), REPO, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    out = result.stdout
    assert "unknown config key 'train.stpes'; did you mean 'train.steps'?" in out
    assert f"{runs / 'notebook'} already finished at step 1 (train.steps=1); raise train.steps to continue" in out
    for name in ("notebook", "sweep_rl", "sweep_sft"):
        assert (runs / name / "metrics.jsonl").is_file(), name


def test_ray_workers_import_user_modules_from_the_drivers_working_directory(tmp_path):
    """A model reward of the user's (`my_rewards:judge`, a `ModelReward` whose options and scorer classes live
    in `./my_rewards.py`) resolves on the driver and is built and scored in a Ray worker, with neither the
    worker's `sys.path` nor PYTHONPATH set by hand: the driver is a script in another directory."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_rewards.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        from rollflow.rewards.registry import ModelReward


        @dataclass(frozen=True)
        class Options:
            bonus: float = 0.0


        class Scorer:
            def __init__(self, options, device="cpu"):
                self.bonus = options.bonus

            async def score_group(self, completions, rows):
                return [float(c == r["answer"]) + self.bonus for c, r in zip(completions, rows)]


        judge = ModelReward("my_rewards:Scorer", Options)
    '''))
    driver = textwrap.dedent('''
        import asyncio

        import ray

        from rollflow.cluster.ray_session import start_ray, stop_ray
        from rollflow.rewards.registry import resolve_reward

        reward = resolve_reward("my_rewards:judge", {"bonus": 0.5})  # on the driver: imports ./my_rewards.py


        @ray.remote(num_cpus=0)
        def score(reward, completions, rows):  # in a worker: unpickles Options, imports the scorer
            return asyncio.run(reward.build().score_group(completions, rows))


        start_ray(num_cpus=1)
        try:
            print("scores", ray.get(score.remote(reward, ["2", "3"], [{"answer": "2"}, {"answer": "2"}]),
                                    timeout=120))
        finally:
            stop_ray()
    ''')
    result = _run(driver, project, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "scores [1.5, 0.5]" in result.stdout
