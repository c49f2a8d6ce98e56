"""Where a command's CPU goes, by kind of process: Ray's role workers by class, Ray's own processes, vLLM, the
command's subprocesses. For the test suite's budget (tests/README.md): `--cpu-report` says which tests cost the
most, this says which processes.

It runs the command and, once a second, reads every process's user + system CPU time from /proc (Linux), keeping
the last value of each process (pid and start time) and its latest command line; a process that started before
the command counts from the first look. At the end it prints the CPU seconds by kind, the number of processes of
each kind, and the whole machine's busy CPU seconds meanwhile. A process that lives less than a second is missed
(its CPU goes uncounted, so the kinds sum to a little less than the machine's total).

Usage: python bench/cpu_by_process.py [--json PATH] -- python -m pytest -q -n 2 --dist loadgroup
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
RAY_SYSTEM = ("gcs_server", "raylet", "log_monitor", "dashboard/agent", "runtime_env/agent", "monitor.py")


def kind(command: str, name: str, root: int, pid: int) -> str:
    """The kind of process `command` (its command line; `name`: /proc's short name) is."""
    if pid == root:
        return "the command"
    if command.startswith("ray::"):
        return "ray::" + re.split(r"[ .:]", command[5:])[0]  # an actor's class, or IDLE / a system agent
    if "default_worker.py" in command:
        return "ray worker starting"
    for system in RAY_SYSTEM:
        if system in command:
            return f"ray system: {system}"
    if "rollflow_ray_reaper" in command:
        return "ray system: rollflow reaper"
    if "resource_tracker" in command:
        return "multiprocessing resource tracker"
    if "vllm" in command.lower() or name.startswith("VLLM") or "spawn_main" in command:
        return "vllm / multiprocessing spawn"
    if "pytest-xdist" in name or "exec(eval(sys.stdin.readline()))" in command:
        return "pytest-xdist worker"
    if re.search(r"rollflow(\.cli)?\b| -m rollflow", command):
        return "rollflow command line"
    if "python" in command:
        return "other python"
    return f"other: {name}"


def snapshot(seen: dict, root: int, first: bool) -> None:
    """Update `seen` ((pid, start) -> [CPU ticks at first look, latest ticks, kind]) from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks, start = int(fields[11]) + int(fields[12]), int(fields[19])
        key = (int(entry), start)
        found = kind(command, name, root, int(entry)) if command else None
        if key not in seen:
            seen[key] = [ticks if first else 0, ticks, found or "kernel threads"]  # no command line: the kernel's
        else:
            seen[key][1] = ticks
            if found and not found.startswith(("ray worker starting", "other")):  # a worker became an actor
                seen[key][2] = found


def busy_ticks() -> int:
    """Ticks the whole machine spent busy since boot: every /proc/stat state but idle and iowait, as the test
    suite's `--cpu-report` counts them (tests/conftest.py `_busy_cpu_seconds`), so the two agree."""
    with open("/proc/stat") as file:
        fields = [int(value) for value in file.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    seen: dict = {}
    began, busy = time.monotonic(), busy_ticks()
    try:
        process = subprocess.Popen(command)
    except OSError as err:  # no such program, not executable
        print(f"cpu_by_process: cannot run {command[0]!r}: {err.strerror}", file=sys.stderr)
        return 2
    snapshot(seen, process.pid, first=True)
    while process.poll() is None:
        time.sleep(1.0)
        snapshot(seen, process.pid, first=False)
    wall, busy = time.monotonic() - began, (busy_ticks() - busy) / TICKS
    seconds, processes = Counter(), Counter()
    for base, latest, name in seen.values():
        if latest > base:
            seconds[name] += (latest - base) / TICKS
            processes[name] += 1
    rows = [{"kind": name, "cpu_s": round(cpu, 1), "processes": processes[name]} for name, cpu in seconds.most_common()]
    print(f"\n{wall:.0f} s, {busy:.0f} busy CPU-s on the machine; by kind of process ({sum(seconds.values()):.0f} "
          "CPU-s seen):", file=sys.stderr)
    for row in rows:
        print(f"{row['cpu_s']:9.1f} CPU-s {row['processes']:5d} processes  {row['kind']}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"wall_s": round(wall, 1), "busy_cpu_s": round(busy, 1), "kinds": rows}))
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
