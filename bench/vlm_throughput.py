"""The VLM quickstart's speed with the vision tower trained vs frozen, and what image preprocessing costs.

Runs `examples/vlm_quickstart.yaml` (GRPO, the bundled tiny Qwen2-VL, count_shapes) for `--steps` steps
twice in one Ray session: `model.freeze_vision_tower: false` (the tower trains, and every weight sync carries
it) and `true`. Each mode's rate is its trained samples over the wall time (`time/step`: rollout, reward,
train, sync) of its steps but the first (warm-up) and the last (it holds the run's final eval). Preprocessing: the processor (resize, normalize,
cut into patches, expand the image tokens, tokenize) over `--rows` count_shapes rows, timed per prompt, set
against a step's time per sample. A prompt is processed once, when the run starts (its pixel values then
travel with its samples), so the per-sample figure is what preprocessing would cost if it ran every step.

Usage: python bench/vlm_throughput.py [--steps 12] [--rows 500]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rollflow.cluster.ray_session import start_ray, stop_ray
from rollflow.config import load_config
from rollflow.data.prompts import PromptEncoder
from rollflow.data.vision import load_vision_processor
from rollflow.data.visual_tasks import visual_task_splits
from rollflow.models import load_tokenizer, resolve_model_path
from rollflow.pipelines.rlvr import run_rlvr

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "vlm_quickstart.yaml"


def preprocessing_seconds(rows: int) -> float:
    """Seconds per prompt to encode `rows` count_shapes rows with the bundled VLM's processor."""
    path = resolve_model_path("tiny-vl")
    tokenizer = load_tokenizer(path)
    encoder = PromptEncoder(tokenizer, processor=load_vision_processor(path, tokenizer))
    sample = visual_task_splits("count_shapes")[0][:rows]
    encoder.encode(sample[0])  # the first call builds the template frame
    started = time.perf_counter()
    for row in sample:
        encoder.encode(row)
    return (time.perf_counter() - started) / len(sample)


def run_mode(frozen: bool, steps: int, out: str) -> dict:
    config = load_config(RECIPE, [f"train.steps={steps}", "eval.every_steps=0", "output.trackers=[jsonl]",
                                  f"model.freeze_vision_tower={str(frozen).lower()}", f"output.dir={out}",
                                  f"name={'frozen' if frozen else 'trained'}"])
    run_rlvr(config, manage_ray=False)
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "time/step" in r][1:-1]  # the first warms up, the last holds the final eval
    samples = config.rollout.groups_per_step * config.rollout.group_size
    seconds = sum(r["time/step"] for r in steps_rows)
    return {"samples_per_s": round(samples * len(steps_rows) / seconds, 1),
            "step_s": round(statistics.median(r["time/step"] for r in steps_rows), 3),
            "train_s": round(statistics.median(r["time/train"] for r in steps_rows), 3),
            "rollout_s": round(statistics.median(r["time/rollout"] for r in steps_rows), 3),
            "samples_per_step": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=500)
    args = parser.parse_args()
    per_prompt = preprocessing_seconds(args.rows)
    start_ray(num_cpus=2)
    try:
        with tempfile.TemporaryDirectory(prefix="rollflow-vlm-bench-") as out:
            trained = run_mode(False, args.steps, out)
            frozen = run_mode(True, args.steps, out)
    finally:
        stop_ray()
    per_sample_step = trained["step_s"] / trained["samples_per_step"]
    print(json.dumps({
        "tower_trained": trained, "tower_frozen": frozen,
        "frozen_over_trained_samples_per_s": round(frozen["samples_per_s"] / trained["samples_per_s"], 3),
        "preprocess_ms_per_prompt": round(per_prompt * 1e3, 3),
        "step_ms_per_sample": round(per_sample_step * 1e3, 3),
        "preprocess_over_step_per_sample": round(per_prompt / per_sample_step, 3),
        "startup_preprocess_s_6000_train_prompts": round(per_prompt * 6000, 2),
    }))


if __name__ == "__main__":
    main()
