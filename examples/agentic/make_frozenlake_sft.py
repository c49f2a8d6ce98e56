"""Scripted-expert FrozenLake steps for the SFT stage of examples/agentic_frozenlake.yaml.

Each row is one step, `{"messages": [{"role": "user", "content": MAP}, {"role": "assistant", "content":
ACTION}]}`: the same prompt the agentic pipeline gives the model with `rollout.samples: step` and
`history_turns: 0`. The expert walks a shortest path, except in a fixed share of states (chosen by a hash of
the map, so the same state always gets the same wrong move): there it writes a deliberate mistake. Greedy
decoding keeps such systematic mistakes (it would wash out random ones), so the SFT model is competent but
not perfect, and RL has something to fix.

    python examples/agentic/make_frozenlake_sft.py --out data/frozenlake --maps 3000

`--observation image` writes the steps of examples/agentic_frozenlake_vl.yaml instead: the board as a PNG
(`images/`, named in each row's `images` column), the user turn `<image>` where it goes, and that config's
system prompt, so the SFT prompt is the agentic step prompt. The mistakes are chosen by the text grid all
the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

import yaml

from rollflow.envs.make import make_env

ACTIONS = ("Left", "Down", "Right", "Up")


# The VL agentic config's own system prompt, read from it so the SFT prompt cannot drift from the RL one.
VL_CONFIG = Path(__file__).resolve().parents[1] / "agentic_frozenlake_vl.yaml"


def mistaken(grid: str, mistake_rate: float) -> str | None:
    """The wrong move this state (its text grid) always gets, or None when the expert's move stands."""
    digest = int(hashlib.sha256(grid.encode()).hexdigest(), 16)
    if (digest % 1000) / 1000 >= mistake_rate:
        return None
    return ACTIONS[(digest // 1000) % len(ACTIONS)]


def expert_rows(seed: int, mistake_rate: float, env_kwargs: dict, max_turns: int,
                image_dir: Path | None = None, system: str | None = None) -> list[dict]:
    """The steps of one episode of map `seed`, played by the mistaken expert; with `image_dir`, image steps
    (each board saved there as a PNG, named relative to its parent, the dataset's directory) under the
    `system` prompt."""
    env = make_env("frozenlake", **env_kwargs)
    observation, info = env.reset(seed=seed)
    rows = []
    for turn in range(max_turns):
        action = mistaken(env.render(), mistake_rate) or env.expert_action()
        row = {"messages": [{"role": "user", "content": observation}, {"role": "assistant", "content": action}]}
        if image_dir is not None:
            name = f"{seed}_{turn}.png"
            info["images"][0].save(image_dir / name)
            row = {"messages": [{"role": "system", "content": system}, *row["messages"]],
                   "images": [f"{image_dir.name}/{name}"]}
        rows.append(row)
        observation, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/frozenlake")
    parser.add_argument("--maps", type=int, default=3000, help="training maps (seeds 0..maps-1)")
    parser.add_argument("--eval-maps", type=int, default=200, help="held-out maps for the SFT eval loss")
    parser.add_argument("--mistake-rate", type=float, default=0.25, help="share of states with a wrong move")
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--observation", choices=("text", "image"), default="text",
                        help="image: the board as a PNG, for examples/agentic_frozenlake_vl.yaml")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_kwargs = {"size": args.size, "max_turns": args.max_turns, "observation": args.observation}
    image_dir = out / "images" if args.observation == "image" else None
    system_vl = None
    if image_dir is not None:
        image_dir.mkdir(exist_ok=True)
        system_vl = yaml.safe_load(VL_CONFIG.read_text())["env"]["system_prompt"]
    splits = {"train": range(args.maps), "eval": range(500_000, 500_000 + args.eval_maps)}
    for split, seeds in splits.items():
        rows = [row for seed in seeds
                for row in expert_rows(seed, args.mistake_rate, env_kwargs, args.max_turns, image_dir, system_vl)]
        random.Random(0).shuffle(rows)
        with open(out / f"{split}.jsonl", "w") as file:
            for row in rows:
                file.write(json.dumps(row) + "\n")
        print(f"{split}: {len(rows)} steps from {len(seeds)} maps -> {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
