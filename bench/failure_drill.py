"""The reliability drill of issue #26: broken envs, degenerate data, absurd settings and faults, each run
through the real command line, and how each ended.

Each case's outcome is one of:
    clean      exit status != 0, stderr ends in exactly one `rollflow: error: ...` line, no traceback
    handled    exit status 0 and the run did what was asked (a harmless setting), or said what it dropped
    traceback  a Python traceback (or more than one error line) on the console
    hang       still running at the case's time limit (killed)
    silent     exit status 0 although nothing (or the wrong thing) was trained, or the console lacks what the
               case expects it to say (`Case.expect`: a warning, a closing line)
    leftover   the case's action found something wrong that the exit cannot show: processes of its Ray left
               behind after a stop signal, a port it did not print, "starting Ray" before a config error
A case whose action sends a stop signal (`Case.signalled`) ends clean with one `rollflow: interrupted` line.

Usage: python bench/failure_drill.py [--only NAME ...] [--out drill.json]
Prints one line per case and a count per outcome; the goal is no traceback, hang or silent case at all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rollflow.cluster.reaper import descendants

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

# issue #44's user files: a reward that raises, an env whose tool results crowd the context, MCP servers that
# write garbage to the protocol's channel or crash with a long traceback
USER_REWARDS = '''
def always_fails(completion, **row):
    raise RuntimeError("this reward is broken")

def fails_on_multiples_of_3(completion, **row):
    if int(row["answer"]) % 3 == 0:
        raise ValueError(f"cannot score answer {row['answer']}")
    return float(completion.strip() == str(row["answer"]))
'''

CROWD_ENV = '''
class Env:
    def reset(self, seed=None):
        return "347*29", {}

    def step(self, action):
        return "tool result: " + "1234567890" * 15, 0.0, False, False, {}

def make(**kwargs):
    return Env()
'''

GARBAGE_MCP_SERVER = '''
for number in range(50):
    print(f"garbage line {number}: a print() that should have gone to stderr", flush=True)
'''

CRASHING_MCP_SERVER = '''
def deep(depth):
    if depth == 0:
        raise RuntimeError("the tool's dependency is broken")
    return deep(depth - 1)


deep(40)
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
    signalled: bool = False  # `during` sends a stop signal: one `rollflow: interrupted` line is its clean end


def agentic(name: str, *overrides: str, files: dict[str, str] | None = None, **kwargs) -> Case:
    return Case(name, ["train", "config.yaml", *AGENTIC, *overrides],
                files={"user_envs.py": USER_ENVS, **(files or {})}, **kwargs)


def tool_use(*tools: str) -> tuple[str, str]:
    """The overrides of a `tool_use` env with these tool specs (YAML) around the add2 prompts."""
    return ("env.id=tool_use", "env.kwargs={tools: [" + ", ".join(tools) + "], env: prompts, "
                               "env_kwargs: {task: add2, reward: exact_match}}")


def dpo_pairs(rows: list[dict]) -> dict[str, str]:
    return {"pairs.jsonl": "".join(json.dumps(row) + "\n" for row in rows)}


PAIR = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
DPO_DATA = ["data.train={path: pairs.jsonl}", "data.eval={path: pairs.jsonl}"]  # the example's files are not here
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
    Case("DPO chosen == rejected", ["dpo", str(ROOT / "examples/dpo.yaml"), *DPO_DATA],
         files=dpo_pairs([{**PAIR, "rejected": "3"}] * 4)),
    Case("DPO empty chosen", ["dpo", str(ROOT / "examples/dpo.yaml"), *DPO_DATA],
         files=dpo_pairs([{**PAIR, "chosen": ""}] * 4)),
    Case("DPO empty rejected", ["dpo", str(ROOT / "examples/dpo.yaml"), *DPO_DATA],
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
    Case("run directory made unwritable mid-run", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                                   "train.steps=200", "output.save_every_steps=1"],
         during="make_run_dir_immutable"),
    Case("RL with a reward that never changes", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                                 "train.steps=4", "reward.functions=[{name: flat_reward:zero}]"],
         files={"flat_reward.py": "def zero(completion, **row):\n    return 0.0\n"}, timeout_s=180,
         expect="every group's samples got the same reward"),
    # rewards that raise; data and engine limits that would train the wrong thing silently
    Case("reward raises on every row", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                        "reward.functions=[{name: 'user_rewards:always_fails'}]"],
         files={"user_rewards.py": USER_REWARDS}),
    Case("reward raises on some rows", ["train", str(ROOT / "examples/quickstart.yaml"), *RLVR,
                                        "reward.functions=[{name: 'user_rewards:fails_on_multiples_of_3'}]"],
         files={"user_rewards.py": USER_REWARDS}, harmless=True, expect="samples failed"),
    Case("eval with a reward that raises", ["eval", "--model", "tiny", "data.eval.limit=8", "output.dir=runs",
                                            "reward.functions=[{name: 'user_rewards:always_fails'}]"],
         files={"user_rewards.py": USER_REWARDS}),
    Case("VLM data.image_key names no column", ["train", str(ROOT / "examples/vlm_quickstart.yaml"), *RLVR,
                                                "data.image_key=wrong"]),
    Case("vLLM max_model_len 8 < prompt + response", ["train", str(ROOT / "examples/quickstart_vllm.yaml"), *RLVR,
                                                      "roles.actor_infer.engine_kwargs={max_model_len: 8}"]),
    # the env service's ports and the turns' token budget
    Case("env serve --port -1", ["env", "serve", "frozenlake", "--port", "-1"], timeout_s=60),
    Case("env serve --port 70000", ["env", "serve", "frozenlake", "--port", "70000"], timeout_s=60),
    Case("env serve --port 0 prints the port it got", ["env", "serve", "frozenlake", "--port", "0"],
         during="serve_and_stop", harmless=True, timeout_s=60),
    agentic("agentic system prompt leaves no room for a turn", "env.id=frozenlake", "rollout.max_new_tokens=60",
            "env.system_prompt='" + "Reply with one move: Left, Down, Right or Up. " * 5 + "'", "train.steps=2"),
    agentic("agentic first turn cannot fit the context", "env.id=frozenlake", "env.kwargs={size: 12, max_turns: 40}",
            "rollout.max_new_tokens=100", "train.steps=2"),
    agentic("agentic tool results crowd out the answer", "env.id=crowd_env:make", "rollout.max_new_tokens=60",
            "train.steps=2", files={"crowd_env.py": CROWD_ENV}, harmless=True,
            expect="episodes ended truncated at the context limit"),
    # tools: servers that misbehave, names that do not resolve
    agentic("MCP server prints garbage on stdout", *tool_use("{name: mcp, command: [python, garbage_server.py]}"),
            files={"garbage_server.py": GARBAGE_MCP_SERVER}),
    agentic("MCP server crashes, long stderr traceback",
            *tool_use("{name: mcp, command: [python, crashing_server.py]}"),
            files={"crashing_server.py": CRASHING_MCP_SERVER}),
    agentic("unknown tool name", *tool_use("calculater")),
    agentic("user tool module:attr, module missing", *tool_use("no_such_tools:make")),
    agentic("MCP command not on PATH", *tool_use("{name: mcp, command: [no-such-mcp-server]}")),
    # the planner's sizes, a stop signal during it, config errors before Ray
    Case("plan --gpus 100000", ["plan", str(ROOT / "examples/quickstart.yaml"), "--gpus", "100000", "--out", "plan"],
         timeout_s=120),
    Case("plan --gpus 0", ["plan", str(ROOT / "examples/quickstart.yaml"), "--gpus", "0", "--out", "plan"],
         timeout_s=120),
    Case("plan --gpus -3", ["plan", str(ROOT / "examples/quickstart.yaml"), "--gpus", "-3", "--out", "plan"],
         timeout_s=120),
    Case("config with an unknown key", ["train", "config.yaml", "rollout.max_new_tokns=6"],
         during="no_ray_before_config_error", timeout_s=120),
    Case("SIGTERM during plan", ["plan", str(ROOT / "examples/quickstart.yaml"), "--gpus", "4", "--steps", "3",
                                 "--out", "plan"], during="sigterm_plan", timeout_s=400, signalled=True),
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


SETUPS = {"read_only_dir": read_only_dir, "truncated_model": truncated_model, "small_disk": small_disk}


def kill_env_worker(process: subprocess.Popen, scratch: Path) -> str:
    metrics = scratch / "runs" / "drill" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            for pid in descendants(process.pid):
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if title.startswith("ray::EnvWorker"):
                    os.kill(pid, signal.SIGKILL)
                    return ""
        time.sleep(0.2)
    return "the env worker was never found"


def make_run_dir_immutable(process: subprocess.Popen, scratch: Path) -> str:
    """Once the run logged its first step, nothing new can be created in its run directory or its checkpoints
    (`chattr +i`, which holds for root too, unlike a chmod; a read-only remount is refused while the run holds
    files open for writing). Files already there can still be appended to."""
    run_dir = scratch / "runs" / "drill"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            (run_dir / "checkpoints").mkdir(exist_ok=True)
            done = subprocess.run(["chattr", "+i", str(run_dir), str(run_dir / "checkpoints")], capture_output=True,
                                  text=True)
            return "" if done.returncode == 0 else f"cannot make the run directory immutable: {done.stderr.strip()}"
        time.sleep(0.2)
    return "the run never logged its first step"


def serve_and_stop(process: subprocess.Popen, scratch: Path) -> str:
    """A `rollflow env serve --port 0` case: read the line the server prints first, check that it names the
    port the server answers /health on (not 0), then stop it with SIGTERM (exit 0: `handled`). A wrong or
    missing line SIGKILLs it instead, so the case is not counted as handled; the note says why."""
    if not select.select([process.stdout], [], [], 120)[0]:
        process.kill()
        return "the server printed nothing within 120 s"
    line = process.stdout.readline().strip()
    found = re.search(r"at (http://[^ /]+:(\d+))/\S+ ", line)
    problem = ""
    if found is None or int(found.group(2)) == 0:
        problem = f"the first line does not name the port bound: {line!r}"
    else:
        try:
            with urllib.request.urlopen(f"{found.group(1)}/health", timeout=10) as reply:
                health = json.load(reply)
            if health.get("status") != "ok":
                problem = f"/health at the printed port answered {health}"
        except OSError as err:
            problem = f"nothing answers /health at the printed port ({line!r}: {err})"
    if problem:
        process.kill()
        return problem
    process.send_signal(signal.SIGTERM)
    return ""


SESSION = re.compile(r"/session_\d{4}-\d\d-\d\d_[\d_-]+")  # a Ray session's directory name, in a command line


def _ray_sessions(pids: list[int]) -> set[str]:
    """The Ray session directories the command lines of `pids` name (gcs_server, raylet: `.../session_X/...`)."""
    found = set()
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for match in SESSION.finditer(command):
            found.add(command[:match.end()].rsplit("=", 1)[-1].split("\0")[-1])
    return found


def _session_leftovers(sessions: set[str], grace_s: float = 20.0) -> dict[int, str]:
    """The processes still writing under one of `sessions` (Ray's own, its workers, what they started) once
    `grace_s` has passed for a reaper to end them."""
    from rollflow.cluster.reaper import session_processes

    deadline = time.monotonic() + grace_s
    while True:
        left = {pid: command for session in sessions for pid, command in session_processes(session).items()}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def sigterm_plan(process: subprocess.Popen, scratch: Path) -> str:
    """SIGTERM `rollflow plan` once its first placement's workers are starting (a `ray::` process of the case
    exists), then wait for it to exit and say which processes of its Ray session(s) are left: a plan that
    stops cleanly starts no new Ray on the way out and leaves none. The sessions are gathered from the case's
    processes until it exits (a Ray started in a signal handler or at exit counts too)."""
    sessions: set[str] = set()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        pids = descendants(process.pid)
        sessions |= _ray_sessions(pids)
        titles = []
        for pid in pids:
            try:
                titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                continue
        if any(title.startswith(("ray::RolloutWorker", "ray::ActorTrainWorker")) for title in titles):
            break
        time.sleep(0.2)
    else:
        return "the plan's workers never started"
    os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:  # the sessions of a Ray started on the way out
        sessions |= _ray_sessions(descendants(process.pid))
        time.sleep(0.2)
    if process.poll() is None:
        return f"still running 120 s after SIGTERM (Ray sessions: {sorted(sessions)})"
    left = _session_leftovers(sessions)
    if len(sessions) > 1:
        return f"{len(sessions)} Ray sessions started: {sorted(sessions)}; left behind: {sorted(left.values())}"
    return f"left behind: {len(left)} processes: {sorted(left.values())}" if left else ""


def no_ray_before_config_error(process: subprocess.Popen, scratch: Path) -> str:
    """Read the case's stdout to its end (at most 120 s): a config the loader refuses says nothing of Ray."""
    out, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
    return "stdout says 'starting Ray' before the config's error" if b"starting Ray" in out else ""


# What runs while a case runs; a non-empty return is what it found wrong (the case's `leftover` note).
ACTIONS = {"kill_env_worker": kill_env_worker, "make_run_dir_immutable": make_run_dir_immutable,
           "serve_and_stop": serve_and_stop, "sigterm_plan": sigterm_plan,
           "no_ray_before_config_error": no_ray_before_config_error}


def classify(case: Case, code: int | None, stderr: str, stdout: str = "") -> str:
    if code is None:
        return "hang"
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("rollflow: warning:")]
    if "Traceback" in stderr or len([line for line in lines if line.startswith("rollflow: error:")]) > 1:
        return "traceback"
    if case.signalled and code in (130, 143) and lines and lines[-1].startswith("rollflow: interrupted"):
        return "clean"
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
    subprocess.run(["chattr", "-R", "-i", str(scratch)], capture_output=True)  # what an action made immutable
    for mount in ("readonly", "small"):
        subprocess.run(["umount", str(scratch / mount)], capture_output=True)
    shutil.rmtree(scratch, ignore_errors=True)
    outcome = classify(case, code, stderr, stdout)
    if problem and outcome in ("clean", "handled"):  # the action found what the exit cannot show
        outcome = "leftover"
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
