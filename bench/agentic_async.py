"""Environment-level asynchrony vs a synchronous batch of envs, with heavy-tailed env latency.

Every mode plays the same FrozenLake groups with the same engine and env workers (Ray actors of the agentic
pipeline, bundled tiny model): `--groups` groups of `--group-size` episodes a step, every episode
`--turns` turns long (the untrained model's moves are mostly invalid, so no episode ends early and every
mode does the same work). Every env step first sleeps a log-normal delay (median `--median-s`, shape
`--sigma`: `env.simulated_latency`). `lockstep` is the synchronous baseline: a turn starts once every
episode of the step has finished the previous one. `async` lets every env loop on its own (a step still
waits for its slowest group); `async_redundancy` also starts `--redundancy` spare episodes per group and keeps
the first `--group-size` that finish; `async_across_steps` (`max_staleness: 1`) starts the next step's groups
while this step's finish, so no step waits for a straggler. Each mode runs `--repeats` steps after a warm-up
step; each mode's rate is its trajectories over the wall time of all its steps. `--service N` plays the same
envs through N local `rollflow env serve` servers (`env.id`: the list of their URLs; the delay still sleeps in
the env workers, in front of the HTTP call), so the figures include what serving envs over HTTP costs.

Usage: python bench/agentic_async.py [--groups 8] [--group-size 8] [--turns 6] [--median-s 0.05] [--sigma 1.5]
       [--repeats 4] [--service 0]
Prints one JSON line: trajectories/s of each mode and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.cluster.runtime import pin_threads
from rollflow.config import load_config
from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus
from rollflow.engines.base import SamplingParams
from rollflow.envs.local_servers import start_env_servers, stop_env_servers
from rollflow.models import load_tokenizer
from rollflow.pipelines.agentic import env_rollout, episode_settings
from rollflow.workers.roles import start_roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--median-s", type=float, default=0.05)
    parser.add_argument("--sigma", type=float, default=1.5)
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--redundancy", type=int, default=2, help="spare episodes per group (async_redundancy)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--service", type=int, default=0,
                        help="play the envs through this many local `rollflow env serve` servers (0: in process)")
    args = parser.parse_args()
    pin_threads(1)
    env_kwargs = {"size": 3, "max_turns": args.turns}
    servers = start_env_servers("frozenlake", args.service, env_kwargs, ["--max-sessions", "4096"])
    try:
        figures = run(args, env_kwargs, [url for url, _ in servers])
    finally:
        stop_env_servers(process for _, process in servers)
    print(json.dumps(figures))


def run(args: argparse.Namespace, env_kwargs: dict, urls: list[str]) -> dict:
    """Every mode's rate, in process or (`urls`) through the env servers."""
    env_id = f"[{', '.join(urls)}]" if urls else "frozenlake"
    config = load_config(None, [
        "pipeline=agentic", f"env.id={env_id}", f"env.kwargs={json.dumps(env_kwargs)}",
        f"env.max_turns={args.turns}", f"env.simulated_latency={{median_s: {args.median_s}, sigma: {args.sigma}}}",
        f"rollout.groups_per_step={args.groups}", f"rollout.group_size={args.group_size}",
        "rollout.max_new_tokens=4", f"roles.env.num_workers={args.env_workers}"])
    tokenizer = load_tokenizer(config.model.path)
    start_ray(num_cpus=2)
    groups = start_roles(config, ["actor_infer", "env"])
    try:
        modes = {  # name -> rollout settings that differ from the config's
            "lockstep": {"lockstep": True},
            "async": {},
            "async_redundancy": {"group_redundancy": args.redundancy},
            "async_across_steps": {"max_staleness": 1},
        }
        rollouts = {}
        for mode, update in modes.items():
            mode_config = config.model_copy(update={"rollout": config.rollout.model_copy(update=update)})
            rollouts[mode] = env_rollout(mode_config, groups["actor_infer"].handles, groups["env"].handles,
                                         TurnEncoder(tokenizer), episode_settings(mode_config, 256),
                                         SamplingParams(4))
        rates: dict[str, list[float]] = {mode: [] for mode in rollouts}
        turns: dict[str, list[float]] = {mode: [] for mode in rollouts}
        for mode, rollout in rollouts.items():  # one mode at a time: the engine serves only it
            rollout.next_batch(1, 0)  # warm-up (and, across steps, the start of the play-ahead)
            started = time.perf_counter()
            count = 0
            for step in range(2, args.repeats + 2):
                result = rollout.next_batch(step, 0)
                episodes = [s for s in result.samples if s.status != SampleStatus.FAILED
                            and s.status != SampleStatus.FILTERED]  # trajectory samples: one per episode
                count += len(episodes)
                turns[mode].append(sum(e.metadata["turns"] for e in episodes) / max(len(episodes), 1))
            # over all the steps: a play-ahead step can return at once with groups played during the last one
            rates[mode].append(count / (time.perf_counter() - started))
            rollout.close()
    finally:
        groups.shutdown()
        stop_ray()
    median = {mode: values[0] for mode, values in rates.items()}
    figures = {"episodes_per_step": args.groups * args.group_size,
               "turns_per_episode": round(statistics.mean(turns["async"]), 2),
               "env_latency": f"lognormal(median {args.median_s} s, sigma {args.sigma})",
               "env_servers": len(urls)}
    figures.update({f"{mode}_trajectories_per_s": round(rate, 2) for mode, rate in median.items()})
    figures.update({f"{mode}_over_lockstep": round(rate / median["lockstep"], 2)
                    for mode, rate in median.items() if mode != "lockstep"})
    return figures


if __name__ == "__main__":
    main()
