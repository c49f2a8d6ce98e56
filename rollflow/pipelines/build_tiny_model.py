"""`rollflow build-tiny-model --out DIR [--vl]`: rebuild a bundled tiny model from its SFT recipe.

It runs the two steps a user would (`rollflow new-model`, then `rollflow sft examples/sft_tiny.yaml`) in a
temporary directory and exports the model the run stopped at: the HF model files and the tokenizer, without
the optimizer state, plus `rollflow_build.json` (the recipe, the step it stopped at, its eval, the versions).
The recipe trains on one thread, so a rebuild is byte-identical where the floating-point arithmetic is the same
(CPU kind, torch, transformers, rollflow's training kernels): `rollflow/assets/tiny-qwen2-add` is what this
command wrote on 2026-12-02. Elsewhere the run crosses the accuracy threshold at another step and exports
another model; the command ends by saying which it is (`same_as_bundled`).

With `--vl` it rebuilds the bundled tiny vision-language model the same way (`rollflow new-model --vl`, then
`rollflow sft examples/sft_tiny_vl.yaml`): `rollflow/assets/tiny-qwen2vl-count`, also with its image processor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers

from rollflow.config import load_config
from rollflow.errors import ConfigError
from rollflow.fresh_model import save_fresh_model, save_fresh_vl_model
from rollflow.pipelines.run_directory import latest_checkpoint
from rollflow.pipelines.supervised import run_supervised

TINY_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen2-add"
TINY_VL_MODEL_DIR = TINY_MODEL_DIR.parent / "tiny-qwen2vl-count"
BUILD_INFO_FILE = "rollflow_build.json"
WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_ONLY = ("trainer_state.pt", "rollflow_checkpoint.json")  # what a checkpoint adds to a model


def build(args: argparse.Namespace, manage_ray: bool = True) -> int:
    """Build, train and export the tiny model (`args`: the CLI's `out`, `seed`, `recipe`, `vl`, `overrides`;
    `recipe` None: the model's own). Returns a process exit code. `manage_ray=False` runs in the caller's Ray
    session."""
    vl = getattr(args, "vl", False)
    args.out = Path(args.out)
    if args.recipe is None:
        args.recipe = Path(__file__).resolve().parents[2] / "examples" / ("sft_tiny_vl.yaml" if vl else "sft_tiny.yaml")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise ConfigError(f"{args.out} exists and is not an empty directory; choose a new --out")
    if not args.recipe.is_file():
        raise ConfigError(f"recipe not found: {args.recipe} (it ships in the repository's examples/)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollflow-tiny-model-") as scratch:
        initial = Path(scratch) / "init"
        num_params = (save_fresh_vl_model if vl else save_fresh_model)(initial, seed=args.seed)
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
        "command": f"rollflow build-tiny-model --out {args.out} --seed {args.seed}" + (" --vl" if vl else "")
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
    print(same_as_bundled(args.out, TINY_VL_MODEL_DIR if vl else TINY_MODEL_DIR))
    return 0


def same_as_bundled(built: Path, bundled: Path = TINY_MODEL_DIR) -> str:
    """Whether `built` holds byte for byte the weights of the bundled model in `bundled`, said in one line."""
    if not (bundled / BUILD_INFO_FILE).is_file():
        return f"no bundled model in {bundled} to compare with"
    bundled_info = json.loads((bundled / BUILD_INFO_FILE).read_text())
    if file_digest(built / WEIGHTS_FILE) == file_digest(bundled / WEIGHTS_FILE):
        return f"the weights are byte for byte the bundled model's (rollflow/assets/{bundled.name})"
    return (f"the weights differ from the bundled model's (step {bundled_info['steps']}, accuracy "
            f"{bundled_info['eval']['accuracy']:.3f}): this machine's float arithmetic (CPU kind, torch, "
            "transformers or rollflow's training kernels) differs from the build's, so the run crossed the "
            "threshold elsewhere (docs/tiny_model.md)")


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
