"""Reward throughput: sandboxed code executions per second (pool vs one at a time) and math verifications.

Usage: python bench/reward_throughput.py [--programs 32] [--parallel N] [--math 2000]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from rollflow.rewards import math_answer
from rollflow.rewards.math_verifier import default_verifier
from rollflow.rewards.sandbox import Sandbox, SandboxLimits
from rollflow.rewards.sandbox_isolation import detect_isolation

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)))\n"


def code_rate(programs: int, parallel: int) -> float:
    """Executions per second of a small stdin/stdout program with `parallel` runs at a time."""
    sandbox = Sandbox(SandboxLimits(wall_time_s=10, cpu_time_s=10), max_parallel=parallel)
    sandbox.run_python(PROGRAM, stdin="10")  # warm the page cache
    start = time.perf_counter()
    results = sandbox.map(lambda n: sandbox.run_python(PROGRAM, stdin=str(n)), range(1000, 1000 + programs))
    elapsed = time.perf_counter() - start
    assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
    return programs / elapsed


def math_rate(calls: int, completion: str, answer: str) -> float:
    math_answer(completion, answer=answer)  # start the helper process outside the timing
    start = time.perf_counter()
    for _ in range(calls):
        assert math_answer(completion, answer=answer) == 1.0
    return calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=max(2, os.cpu_count() or 1) * 2)
    parser.add_argument("--math", type=int, default=2000)
    args = parser.parse_args()
    sequential = code_rate(args.programs, 1)
    pooled = code_rate(args.programs, args.parallel)
    fast = math_rate(args.math, "So the total is \\boxed{42}.", "42")
    # Not decidable by the fast path: math-verify parses LaTeX in a helper process.
    slow = math_rate(max(1, args.math // 10), "Hence \\boxed{\\frac{\\sqrt{8}}{4}}.", "\\frac{1}{\\sqrt{2}}")
    default_verifier().close()
    print(
        json.dumps(
            {
                "isolation": detect_isolation(),
                "cpu_count": os.cpu_count(),
                "code_programs": args.programs,
                "code_parallel": args.parallel,
                "code_exec_per_s_sequential": round(sequential, 1),
                "code_exec_per_s_pool": round(pooled, 1),
                "code_pool_speedup": round(pooled / sequential, 2),
                "math_verify_per_s_fast_path": round(fast, 1),
                "math_verify_per_s_math_verify": round(slow, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
