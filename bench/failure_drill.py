"""The reliability drill of issue #26: broken envs, degenerate data, absurd settings and faults, each run
through the real command line, and how each ended.

Each case's outcome is one of:
    clean      exit status != 0, stderr ends in exactly one `rollflow: error: ...` line, no traceback
    handled    exit status 0 and the run did what was asked (a harmless setting), or said what it dropped
    traceback  a Python traceback (or more than one error line) on the console
    hang       still running at the case's time limit (killed)
    silent     exit status 0 although nothing (or the wrong thing) was trained, or the console lacks what the
               case expects it to say (`Case.expect`: a warning, a closing line)

Usage: python bench/failure_drill.py [--only NAME ...] [--out drill.json]
Prints one line per case and a count per outcome; the goal is no traceback, hang or silent case at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

USER_ENVS = '''
import math, time

class Env:
    def __init__(self, breaks="nothing"):
        self.breaks = breaks

    def reset(self, seed=None):
        if self.breaks == "reset":
            raise RuntimeError("reset is broken")
        if self.breaks == "dict_observation":
            return {"board": [1, 2]}, {}
        if self.breaks == "none_observation":
            return None, {}
        return "pick a number", {}

    def step(self, action):
        results = {"step": None, "nan": ("x", math.nan, False, False, {}), "four_tuple": ("x", 1.0, False, {}),
                   "string_reward": ("x", "1.0", True, False, {}), "hang": None}
        if self.breaks == "step":
            raise ValueError("the board is on fire")
        if self.breaks == "hang":
            time.sleep(3600)
        if self.breaks in results:
            return results[self.breaks]
        time.sleep(0.05)
        return "go on", 0.0, False, False, {}

def make(**kwargs):
    return Env(**kwargs)
'''

AGENTIC = ["pipeline=agentic", "env.max_turns=3", "env.step_timeout_s=2", "rollout.groups_per_step=2",
           "rollout.group_size=2", "eval.episodes=2", "eval.every_steps=0", "train.steps=20",
           "output.trackers=[jsonl]"]
RLVR = ["train.steps=3", "eval.every_steps=0", "data.eval.limit=8", "rollout.groups_per_step=8",
        "output.trackers=[jsonl]"]


@dataclass
class Case:
    name: str
    argv: list[str]  # after `rollflow`
    files: dict[str, str] = field(default_factory=dict)  # scratch-relative path -> text
    setup: str = ""  # a name in SETUPS
    during: str = ""  # a name in ACTIONS, run once the run's first step is logged
    timeout_s: float = 240.0
    harmless: bool = False  # exit 0 is the right outcome (a setting that must simply work)
    expect: str = ""  # a text the console must show (a warning, a closing line); missing it is `silent`


def agentic(name: str, *overrides: str, files: dict[str, str] | None = None, **kwargs) -> Case:
    return Case(name, ["train", "config.yaml", *AGENTIC, *overrides],
                files={"user_envs.py": USER_ENVS, **(files or {})}, **kwargs)


def dpo_pairs(rows: list[dict]) -> dict[str, str]:
    return {"pairs.jsonl": "".join(json.dumps(row) + "\n" for row in rows)}


PAIR = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
CASES = [
    agentic("env step raises", "env.id=user_envs:make", "env.kwargs={breaks: step}"),
    agentic("env reset raises", "env.id=user_envs:make", "env.kwargs={breaks: reset}"),
    agentic("env reward NaN", "env.id=user_envs:make", "env.kwargs={breaks: nan}"),
    agentic("env step returns a 4-tuple", "env.id=user_envs:make", "env.kwargs={breaks: four_tuple}"),
    agentic("env reward is a string", "env.id=user_envs:make", "env.kwargs={breaks: string_reward}"),
    agentic("env step hangs past step_timeout_s", "env.id=user_envs:make", "env.kwargs={breaks: hang}"),
    agentic("env observation is a dict", "env.id=user_envs:make", "env.kwargs={breaks: dict_observation}"),
    agentic("env observation is None", "env.id=user_envs:make", "env.kwargs={breaks: none_observation}"),
    agentic("frozenlake refuses max_turns: 4", "env.id=frozenlake", "env.kwargs={max_turns: 4}"),
    agentic("env kwarg the constructor lacks", "env.id=frozenlake", "env.kwargs={sz: 4}"),
    agentic("GEM kwarg misspelt", "env.id=gem:game:GuessTheNumber-v0-easy", "env.kwargs={max_turn: 4}"),
    agentic("env module with a syntax error", "env.id=syntax_env:make",
            files={"syntax_env.py": "def make(:\n    pass\n"}),
    agentic("env module raises at import", "env.id=raising_env:make",
            files={"raising_env.py": "raise RuntimeError('boom at import')\n"}),
    agentic("env module:factory, module missing", "env.id=no_such_env:make"),
    agentic("env worker killed (kill -9)", "env.id=user_envs:make", "train.steps=500", during="kill_env_worker"),
    Case("env play --policy random on GEM", ["env", "play", "gem:game:Minesweeper-v0-easy", "--policy", "random",
                                             "--max-steps", "5"], harmless=True),
    Case("DPO chosen == rejected", ["dpo", str(ROOT / "examples/dpo.yaml"), "data.train={path: pairs.jsonl}"],
         files=dpo_pairs([{**PAIR, "rejected": "3"}] * 4)),
    Case("DPO empty chosen", ["dpo", str(ROOT / "examples/dpo.yaml"), "data.train={path: pairs.jsonl}"],
         files=dpo_pairs([{**PAIR, "chosen": ""}] * 4)),
    Case("DPO empty rejected", ["dpo", str(ROOT / "examples/dpo.yaml"), "data.train={path: pairs.jsonl}"],
         files=dpo_pairs([{**PAIR, "rejected": ""}] * 4)),
    Case("SFT empty response", ["sft", "config.yaml", "data.train={path: rows.jsonl}", "train.steps=2"],
         files={"rows.jsonl": json.dumps({"prompt": "1+2=", "response": ""}) + "\n"}),
    Case("max_staleness 1,000,000", ["train", str(ROOT / "examples/async.yaml"), "rollout.max_staleness=1000000",
                                     *RLVR], timeout_s=180, harmless=True),
    Case("output.dir is a file", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR, "output.dir=afile"],
         files={"afile": "not a directory\n"}),
    Case("output.dir read-only", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR, "output.dir=readonly"],
         setup="read_only_dir"),
    Case("cluster.address unreachable", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                         "cluster.address=127.0.0.1:1"], timeout_s=120),
    Case("truncated safetensors", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR, "model.path=truncated"],
         setup="truncated_model"),
    Case("disk full during a checkpoint", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                           "output.dir=small", "output.save_every_steps=1"], setup="small_disk"),
    # issue #44: the end of a pipeline, the run directory mid-run, a run that cannot learn
    Case("SFT whose best checkpoint is not its last step", ["sft", str(ROOT / "examples/small_data/sft.yaml"),
         "data.train={path: rows.jsonl}", "data.eval={path: rows.jsonl}", "train={steps: 4, batch_size: 16, "
         "train_micro_batch_size: 16, lr: 1.0e-12, best_checkpoint_metric: val/accuracy}", "eval.every_steps=2"],
         files={"rows.jsonl": "".join(json.dumps({"prompt": f"{a}-{b}", "answer": str(a - b)}) + "\n"
                                      for a in range(40, 60) for b in range(10, 14))},
         timeout_s=180, harmless=True, expect="best checkpoint: step 0"),
    Case("run directory made read-only mid-run", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                                  "train.steps=200", "output.dir=rw", "output.save_every_steps=1"],
         setup="bind_mount", during="remount_read_only"),
    Case("RL with a reward that never changes", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                                 "train.steps=4", "reward.functions=[{name: flat_reward:zero}]"],
         files={"flat_reward.py": "def zero(completion, **row):\n    return 0.0\n"}, timeout_s=180,
         expect="every group's samples got the same reward"),
]


def read_only_dir(scratch: Path) -> str:
    """A read-only bind mount of a directory (root ignores chmod): needs mount, as root."""
    (scratch / "readonly").mkdir()
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(scratch / "readonly"), str(scratch / "readonly")],
                          capture_output=True, text=True)
    if done.returncode:  # some kernels need the read-only flag in a remount
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(scratch / "readonly")], capture_output=True,
                              text=True)
    return "" if done.returncode == 0 else f"cannot mount read-only: {done.stderr.strip()}"


def truncated_model(scratch: Path) -> str:
    from rollflow.models import resolve_model_path

    shutil.copytree(resolve_model_path("tiny"), scratch / "truncated")
    weights = scratch / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ""


def small_disk(scratch: Path) -> str:
    """A 3 MiB tmpfs: the run directory fits, a checkpoint (~13 MB with its optimizer) does not."""
    (scratch / "small").mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(scratch / "small")],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else f"cannot mount a tmpfs: {done.stderr.strip()}"


def bind_mount(scratch: Path) -> str:
    """`rw` bind-mounted on itself, so that an action can remount it read-only while the run writes there."""
    (scratch / "rw").mkdir()
    done = subprocess.run(["mount", "--bind", str(scratch / "rw"), str(scratch / "rw")], capture_output=True,
                          text=True)
    return "" if done.returncode == 0 else f"cannot bind-mount: {done.stderr.strip()}"


SETUPS = {"read_only_dir": read_only_dir, "truncated_model": truncated_model, "small_disk": small_disk,
          "bind_mount": bind_mount}


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_env_worker(process: subprocess.Popen, scratch: Path) -> str:
    metrics = scratch / "runs" / "drill" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            for pid in _descendants(process.pid):
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if title.startswith("ray::EnvWorker"):
                    os.kill(pid, signal.SIGKILL)
                    return ""
        time.sleep(0.2)
    return "the env worker was never found"


def remount_read_only(process: subprocess.Popen, scratch: Path) -> str:
    """Once the run logged its first step, its output directory's mount turns read-only under it."""
    metrics = scratch / "rw" / "drill" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            done = subprocess.run(["mount", "-o", "remount,bind,ro", str(scratch / "rw")], capture_output=True,
                                  text=True)
            return "" if done.returncode == 0 else f"cannot remount read-only: {done.stderr.strip()}"
        time.sleep(0.2)
    return "the run never logged its first step"


ACTIONS = {"kill_env_worker": kill_env_worker, "remount_read_only": remount_read_only}


def classify(case: Case, code: int | None, stderr: str, stdout: str = "") -> str:
    if code is None:
        return "hang"
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("rollflow: warning:")]
    if "Traceback" in stderr or len([line for line in lines if line.startswith("rollflow: error:")]) > 1:
        return "traceback"
    if case.expect and case.expect not in stdout + stderr:
        return "silent"
    if code == 0:
        return "handled" if case.harmless or "rollflow: warning:" in stderr else "silent"
    return "clean" if len(lines) == 1 and lines[0].startswith("rollflow: error:") else "traceback"


def run(case: Case) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="drill-"))
    (scratch / "config.yaml").write_text("name: drill\n")
    for path, text in case.files.items():
        (scratch / path).write_text(text)
    problem = SETUPS[case.setup](scratch) if case.setup else ""
    if problem:
        return {"case": case.name, "outcome": "skipped", "why": problem}
    argv = [sys.executable, "-m", "rollflow.cli", *case.argv]
    if case.argv[0] in ("train", "sft", "dpo", "distill"):
        argv += ["name=drill", *([] if any(a.startswith("output.dir=") for a in case.argv) else
                                 ["output.dir=runs"])]
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    if case.during:
        problem = ACTIONS[case.during](process, scratch)
    try:
        stdout, stderr = process.communicate(timeout=case.timeout_s)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        code = None
    for mount in ("readonly", "small", "rw"):
        subprocess.run(["umount", str(scratch / mount)], capture_output=True)
    shutil.rmtree(scratch, ignore_errors=True)
    outcome = classify(case, code, stderr, stdout)
    errors = [line for line in stderr.splitlines() if line.startswith("rollflow:")]
    return {"case": case.name, "outcome": outcome, "exit": code, "seconds": round(time.monotonic() - started, 1),
            "last_line": (errors or stderr.strip().splitlines() or stdout.strip().splitlines() or [""])[-1][:400],
            **({"note": problem} if problem else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only the cases whose name contains one of these")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(part in c.name for part in args.only)]
    results = []
    for case in cases:
        result = run(case)
        results.append(result)
        print(f"{result['outcome']:9}  {case.name:40}  exit {result.get('exit')}  {result.get('seconds', '-')} s  "
              f"{result.get('last_line', result.get('why', ''))}", flush=True)
    counts = Counter(r["outcome"] for r in results)
    print(json.dumps({"cases": len(results), **dict(counts)}))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
