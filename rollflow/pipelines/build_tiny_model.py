"""`rollflow build-tiny-model --out DIR`: rebuild the bundled tiny model from its SFT recipe.

It runs the two steps a user would (`rollflow new-model`, then `rollflow sft examples/sft_tiny.yaml`) in a
temporary directory and exports the model the run stopped at: the HF model files and the tokenizer, without
the optimizer state, plus `rollflow_build.json` (the recipe, the step it stopped at, its eval, the versions).
The recipe trains on one thread, so a rebuild with the same torch and transformers versions is bit-identical:
`rollflow/assets/tiny-qwen2-add` is exactly what this command writes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.fresh_model import save_fresh_model
from rollflow.pipelines.run_directory import latest_checkpoint
from rollflow.pipelines.supervised import run_supervised

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2-add"
BUILD_INFO_FILE = "rollflow_build.json"
CHECKPOINT_ONLY = ("trainer_state.pt", "rollflow_checkpoint.json")  # what a checkpoint adds to a model


def build(args: argparse.Namespace, manage_ray: bool = True) -> int:
    """Build, train and export the tiny model (`args`: the CLI's `out`, `seed`, `recipe`, `overrides`). Returns a
    process exit code. `manage_ray=False` runs in the caller's Ray session."""
    args.out = Path(args.out)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise ConfigError(f"{args.out} exists and is not an empty directory; choose a new --out")
    if not args.recipe.is_file():
        raise ConfigError(f"recipe not found: {args.recipe} (it ships in the repository's examples/)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollflow-tiny-model-") as scratch:
        initial = Path(scratch) / "init"
        num_params = save_fresh_model(initial, seed=args.seed)
        overrides = [f"model.path={initial}", f"seed={args.seed}", f"output.dir={scratch}", "name=sft",
                     *args.overrides]
        config = load_config(args.recipe, overrides)
        final = run_supervised(config, manage_ray)
        checkpoint = latest_checkpoint(config.run_dir / "checkpoints")
        args.out.mkdir(parents=True, exist_ok=True)
        for path in (checkpoint / "model").iterdir():
            if path.name not in CHECKPOINT_ONLY:
                shutil.copy2(path, args.out / path.name)
    steps = int(checkpoint.name.removeprefix("step_"))
    build_info = {
        "command": f"rollflow build-tiny-model --out {args.out} --seed {args.seed}"
                   + "".join(f" {item}" for item in args.overrides),
        "recipe": str(args.recipe.name),
        "seed": args.seed,
        "num_parameters": num_params,
        "steps": steps,
        "eval": {key.removeprefix("eval/"): value for key, value in final.items()
                 if key in ("eval/accuracy", "eval/loss", "eval/samples")},
        "initial_eval": {key.removeprefix("initial_eval/"): value for key, value in final.items()
                         if key in ("initial_eval/accuracy", "initial_eval/loss")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (args.out / BUILD_INFO_FILE).write_text(json.dumps(build_info, indent=2) + "\n")
    print(f"saved to {args.out}: {num_params:,} parameters, {steps} SFT steps, greedy accuracy "
          f"{final.get('eval/accuracy', float('nan')):.3f} on {int(final.get('eval/samples', 0))} held-out rows, "
          f"in {time.perf_counter() - started:.0f} s")
    return 0
