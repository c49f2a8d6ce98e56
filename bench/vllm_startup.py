"""vLLM's start-up on CPU with its model worker inside the engine-core process (`uni`, rollflow's CPU default)
against a worker process of its own (`mp`, vLLM's CPU default): wall seconds and CPU seconds of the start.

Each start is a fresh Python process that builds a `VLLMEngine` on the bundled tiny model (float32, torch pinned
to `--threads` threads), measures the constructor's wall time, then the CPU seconds of itself and every process
it started (vLLM's engine core and, with `mp`, its worker), and closes the engine. The two settings alternate,
`--repeats` times each, so a busier moment of the machine does not fall on one of them only.

- startup_s: wall time of the engine's constructor, median over the repeats.
- cpu_s: CPU seconds (user + system) of the measuring process and its children once the engine is up, the
  imports of this process included, median.
- processes: how many processes the engine runs besides the caller.
- ratios: uni / mp of startup_s and cpu_s.

Usage: python bench/vllm_startup.py [--repeats 2] [--threads 2]     (needs vLLM's CPU build)
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MEASURE = r"""
import json, sys, time

def main():
    import psutil
    import torch

    torch.set_num_threads(int(sys.argv[2]))
    from rollflow.engines.vllm_engine import VLLMEngine
    from rollflow.models import resolve_model_path

    kwargs = {"distributed_executor_backend": sys.argv[1]}
    started = time.perf_counter()
    engine = VLLMEngine(resolve_model_path("tiny"), dtype="float32", max_batch_size=64, **kwargs)
    startup = time.perf_counter() - started
    me = psutil.Process()
    children = me.children(recursive=True)
    cpu = sum(sum(p.cpu_times()[:2]) for p in [me, *children])
    engine.close()
    print(json.dumps({"startup_s": startup, "cpu_s": cpu, "processes": len(children)}))

if __name__ == "__main__":
    main()
"""


def measure(backend: str, threads: int) -> dict:
    result = subprocess.run([sys.executable, "-c", MEASURE, backend, str(threads)], capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"vLLM did not start with {backend}: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"uni": [], "mp": []}
    for _ in range(args.repeats):
        for backend in runs:
            runs[backend].append(measure(backend, args.threads))
    out = {backend: {key: round(statistics.median(run[key] for run in measured), 2)
                     for key in ("startup_s", "cpu_s", "processes")} for backend, measured in runs.items()}
    out["ratios"] = {key: round(out["uni"][key] / out["mp"][key], 2) for key in ("startup_s", "cpu_s")}
    out["repeats"], out["threads"] = args.repeats, args.threads
    print(json.dumps(out))


if __name__ == "__main__":
    main()
