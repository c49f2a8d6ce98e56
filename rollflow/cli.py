"""`rollflow` command line: train (RLVR, or the pipeline a config names), sft, dpo, distill, eval, plan (simulate
a config's placements on simulated GPUs), env (play an environment), new-model, build-tiny-model.

User errors (bad config, missing files, unloadable reward) print one line and exit with status 2; a run that
fails at run time (a dead or stalled worker, non-finite training) prints one line and exits with status 1; a
stop signal exits with 130 (SIGINT) or 143 (SIGTERM) after saving the last finished step. A resumed run that
has nothing left to do prints why and exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

EXIT_USER_ERROR = 2
# `rollflow.config.values.MAX_NAME_LENGTH` (a test keeps the two equal): the parser imports nothing of the config,
# so `rollflow --help` and a bad command are answered before pydantic loads
MAX_NAME_LENGTH = 100
# Path parts that say nothing of which model it is: a checkpoint's `model/`, a LoRA checkpoint's `merged/`.
_ANONYMOUS_PARTS = {"", ".", "..", "model", "merged", "checkpoints"}


def _train(args: argparse.Namespace) -> int:
    """Run the pipeline the config names (`pipeline:`, default rlvr) through `rollflow.pipelines.PIPELINES`."""
    from rollflow.config import dump_config, load_config
    from rollflow.errors import RollflowError, WorkerDiedError

    overrides = args.overrides
    if args.pipeline is not None:  # `rollflow sft CFG`: the config may leave `pipeline` out, or must say sft
        from rollflow.config import pipeline_of

        named = pipeline_of(args.config)
        if named is not None and named != args.pipeline:
            from rollflow.errors import ConfigError

            raise ConfigError(f"`rollflow {args.pipeline}` runs the {args.pipeline} pipeline, but {args.config} "
                              f"says `pipeline: {named}`; run `rollflow train {args.config}` or fix the config")
        overrides = [f"pipeline={args.pipeline}", *overrides]
    config = load_config(args.config, overrides)
    if args.print_config:
        print(dump_config(config), end="")
        return 0
    if not args.print_plan:
        _prestart_ray(config)
    from rollflow.pipelines import PIPELINES, run

    pipeline = PIPELINES.get(config.pipeline)
    if args.print_plan:
        from rollflow.workers.roles import describe_plan

        print(describe_plan(config, pipeline.roles_of(config)))
        return 0
    try:
        final = run(config)
    except RollflowError as err:
        if isinstance(err, WorkerDiedError):
            err.args = (f"{err}; {_checkpoint_note(config.run_dir)}",)
        _keep_worker_traceback(err, config.run_dir)
        raise
    print(f"run directory: {config.run_dir}")
    return 0 if final else 1


def _prestart_ray(config) -> None:
    """Have a local Ray start in a process of its own now (`rollflow.cluster.prestart.prestart_ray`), once the
    config loaded (without torch: in well under a second) and before the pipeline imports torch and Ray's
    client (~4 s on 2 cores), which Ray's start (~2.5 s) then overlaps on another core. Only where the config
    asks for a local Ray (`cluster.address` unset) and not for a resume (a finished run must stop at once,
    not after starting Ray); only from a fresh process (torch not imported yet): a test or a notebook calling
    `main` has nothing to overlap. The pipeline's `start_ray` takes this Ray over; `main` discards it when
    the run stops before that."""
    if "torch" in sys.modules or config.cluster.address is not None or config.resume:
        return
    from rollflow.cluster.prestart import prestart_ray
    from rollflow.workers import warm

    prestart_ray(config.cluster.num_cpus, warm_up=warm.SETUP_HOOK,
                 warm_up_env={warm.MODEL_VARIABLE: config.model.path})


def _keep_worker_traceback(err: BaseException, run_dir) -> None:
    """A worker's full traceback (`WorkerError.details`), or every error of a failed step
    (`StepFailedError.details`), goes to `run_dir/error.log`; the one-line message says where."""
    details = getattr(err, "details", "")
    if not details or not run_dir.is_dir():
        return
    path = run_dir / "error.log"
    try:
        path.write_text(details)
    except OSError:
        return
    err.args = (f"{err} ({getattr(err, 'details_label', 'worker traceback')}: {path})",)


def _checkpoint_note(run_dir: Path) -> str:
    """What a run that died leaves to resume from: its newest complete checkpoint, or none."""
    from rollflow.pipelines.run_directory import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        return "no checkpoint was saved yet"
    return f"the last checkpoint, {checkpoint.name}, is intact (resume=true continues from it)"


def _eval_overrides(args: argparse.Namespace) -> list[str]:
    """`rollflow eval`'s flags as config overrides, then the user's own (last: `data.eval.limit=100` wins).
    Without `--name` the eval's directory is named after the model (`eval_directory_name`)."""
    name = eval_directory_name(args.model) if args.name is None else args.name
    overrides = [f"model.path={args.model}", "train.steps=1", f"name={name}"]
    if args.config is None:  # every row, as the quickstart's eval (the schema's default eval set stops at 200)
        overrides.append("data.eval.limit=null")
    if args.data:  # replaces the config's eval set, `task` or `path`
        overrides.append(f"data.eval.path={args.data}")
    return [*overrides, *args.overrides]


def eval_directory_name(model: str) -> str:
    """The directory name `rollflow eval --model MODEL` writes to without `--name`: `eval-` and the model's
    name, so evals of different models never share a directory.

    A checkpoint is named by its run and step (`runs/quick/checkpoints/step_20/model` -> `eval-quick-step_20`),
    another path or hub id by its last part (`tiny` -> `eval-tiny`, `Qwen/Qwen2.5-0.5B` -> `eval-Qwen2.5-0.5B`);
    characters other than letters, digits, `.`, `_` and `-` become `_`.

    Args:
        model: `--model` as given (a bundled name, a directory, a checkpoint or a hub id).
    """
    parts = Path(model).expanduser().parts
    if "checkpoints" in parts:  # runs/NAME/checkpoints/step_N/model[/merged]
        at = len(parts) - 1 - parts[::-1].index("checkpoints")
        named = [part for part in (*parts[at - 1:at], *parts[at + 1:at + 2]) if part not in _ANONYMOUS_PARTS]
    else:
        named = [part for part in parts if part not in _ANONYMOUS_PARTS][-1:]
    if not named:  # `.` or `model`: the directory's own name
        named = [Path(model).expanduser().resolve().name or "model"]
    name = "eval-" + re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(named))
    return name[:MAX_NAME_LENGTH]


def _eval(args: argparse.Namespace) -> int:
    from rollflow.config import load_config

    config = load_config(args.config, _eval_overrides(args))
    _prestart_ray(config)
    from rollflow.pipelines.evaluate import run_eval

    metrics = run_eval(config)
    for key, value in sorted(metrics.items()):
        print(f"{key}: {value:.4g}")
    print(f"eval directory: {config.run_dir} (eval_samples.jsonl: every decoded sample; metrics.jsonl; "
          "config.yaml)")
    return 0


def _build_tiny_model(args: argparse.Namespace) -> int:
    from rollflow.pipelines.build_tiny_model import build

    return build(args)


def _new_model(args: argparse.Namespace) -> int:
    from rollflow.errors import ConfigError
    from rollflow.fresh_model import save_fresh_model, save_fresh_vl_model

    given = {"hidden_size": args.hidden_size, "num_layers": args.layers, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads, "intermediate_size": args.intermediate_size,
             "max_positions": args.max_positions, "rope_theta": args.rope_theta}
    # Sizes left out take `fresh_qwen2_config`'s defaults, so they are written down in one place.
    if args.rope_theta is not None and not args.vl:
        raise ConfigError("--rope-theta is for --vl models (the text model keeps Qwen2's rotary base)")
    save = save_fresh_vl_model if args.vl else save_fresh_model
    num_params = save(args.out, seed=args.seed, **{name: value for name, value in given.items() if value is not None})
    print(f"model directory: {args.out}")
    print(f"parameters: {num_params:,}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`rollflow plan`: simulate the config's placements on `--gpus` GPUs of `--profile`, print the best."""
    import json as json_module

    from rollflow.pipelines.plan import format_plan, plan

    if args.lengths_from is not None:
        lengths = {"replay": args.lengths_from}
    else:
        lengths = {"median": args.median_tokens, "tail_ratio": args.tail_ratio}
    out = Path(args.out) if args.out else Path("runs") / f"plan-{Path(args.config).stem}-{args.gpus}gpus"
    result = plan(args.config, args.overrides, args.profile, args.gpus, out, steps=args.steps,
                  time_scale=args.time_scale, max_new_tokens=args.max_new_tokens, lengths=lengths,
                  verbose=args.verbose)
    (out / "plan.json").write_text(json_module.dumps(result, indent=1))
    print(format_plan(result, out))
    print(f"plan: {out / 'plan.json'}")
    return 0


def _remote_cause(err: BaseException) -> BaseException:
    """The worker's own exception when `err` came out of a Ray actor (whose message is a whole traceback)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) and type(err).__name__.startswith("RayTaskError") else err


def _diagnose(args) -> int:
    from rollflow.pipelines.diagnose import diagnose

    print(diagnose(args.run_dir).report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rollflow import __version__

    parser = argparse.ArgumentParser(prog="rollflow", description="RL post-training for LLMs.")
    parser.add_argument("--version", action="version", version=f"rollflow {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run the pipeline a YAML config names (+ key.path=value overrides)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="overrides like rollout.groups_per_step=8")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--print-plan", action="store_true",
                       help="print which worker of which role sits on which device and node, and exit")
    train.set_defaults(handler=_train, pipeline=None)

    for name, what in (("sft", "supervised fine-tuning on conversations"),
                       ("dpo", "preference optimization (DPO, IPO, cDPO) against a frozen reference"),
                       ("distill", "logit distillation from a teacher (roles.reference.model_path)")):
        command = commands.add_parser(name, help=f"{what} (+ key.path=value overrides)")
        command.add_argument("config", help=f"YAML config file (`pipeline: {name}` may be left out)")
        command.add_argument("overrides", nargs="*", help="overrides like train.steps=200")
        command.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        command.add_argument("--print-plan", action="store_true", help="print the placement plan and exit")
        command.set_defaults(handler=_train, pipeline=name)

    planner = commands.add_parser(
        "plan", help="simulate an RLVR config on N GPUs of a hardware profile and recommend the split between "
                     "training and rollout (docs/simulation.md)")
    planner.add_argument("config", help="YAML config file (an RLVR config)")
    planner.add_argument("overrides", nargs="*", help="overrides like rollout.groups_per_step=128")
    planner.add_argument("--gpus", type=int, required=True,
                         help="GPUs to plan for (at most what this machine can simulate: one engine process per "
                              "GPU, 32 per CPU core, memory permitting)")
    planner.add_argument("--profile", default="h800-7b", help="hardware profile (default h800-7b; also h200-7b)")
    planner.add_argument("--steps", type=int, default=6, help="simulated steps per placement (default 6)")
    planner.add_argument("--time-scale", type=float, default=20.0,
                         help="simulated seconds per wall second (default 20)")
    planner.add_argument("--max-new-tokens", type=int, default=None,
                         help="response limit in tokens of the real model (default: rollout.max_new_tokens)")
    planner.add_argument("--median-tokens", type=float, default=300.0, help="median response (default 300)")
    planner.add_argument("--tail-ratio", type=float, default=20.0,
                         help="99th percentile response over the median (default 20)")
    planner.add_argument("--lengths-from", default=None,
                         help="replay the response lengths of a run's samples.jsonl instead")
    planner.add_argument("--out", default=None, help="directory of the simulated runs (default runs/plan-...)")
    planner.add_argument("--verbose", action="store_true",
                         help="print what each simulated run prints (its workers, placement table, warnings) "
                              "instead of writing it to OUT/plan.log")
    planner.set_defaults(handler=_plan)

    diagnose = commands.add_parser(
        "diagnose", help="where a run's step time went and which lever would shorten it (reads RUN_DIR only)")
    diagnose.add_argument("run_dir", type=Path, help="a run directory (output.dir/name)")
    diagnose.set_defaults(handler=_diagnose)

    evaluate = commands.add_parser("eval", help="greedy accuracy of a model on an eval dataset")
    evaluate.add_argument("--model", required=True, help="bundled name, HF directory, checkpoint or hub id")
    evaluate.add_argument("--config", default=None, help="YAML config for data/reward settings")
    evaluate.add_argument("--data", default=None,
                          help="eval dataset (JSONL, parquet, ...), replacing the config's eval set (default: the "
                               "config's; without --config, all 500 held-out sums of add2)")
    evaluate.add_argument("--name", default=None,
                          help="the eval's directory, output.dir/NAME (default: named after the model, e.g. "
                               "eval-tiny, eval-quickstart-step_120); an earlier eval there is moved aside to "
                               "NAME.1")
    evaluate.add_argument("overrides", nargs="*", help="config overrides like data.eval.limit=500")
    evaluate.set_defaults(handler=_eval)

    build = commands.add_parser("build-tiny-model", help="rebuild the bundled tiny model: new-model, then SFT by "
                                "examples/sft_tiny.yaml (--vl: the tiny VLM by examples/sft_tiny_vl.yaml)")
    build.add_argument("--out", required=True, help="directory to write the model into (new or empty)")
    build.add_argument("--seed", type=int, default=0, help="weight initialization and batch order (default 0)")
    build.add_argument("--recipe", type=Path, default=None,
                       help="the SFT config (default: the repository's examples/sft_tiny.yaml, with --vl "
                       "examples/sft_tiny_vl.yaml)")
    build.add_argument("--vl", action="store_true",
                       help="the tiny vision-language model (rollflow/assets/tiny-qwen2vl-count) instead")
    build.add_argument("overrides", nargs="*", help="overrides of the recipe, e.g. train.stop_at_accuracy=0.5")
    build.set_defaults(handler=_build_tiny_model)

    new = commands.add_parser(
        "new-model", help="save a randomly initialized small Qwen2 with the ASCII character tokenizer",
        description="Save a randomly initialized Qwen2 causal LM and the ASCII character tokenizer. Sizes "
        "not given are the bundled tiny model's (hidden 128, 4 layers, 4 heads, 2 key-value heads, MLP 512, "
        "256 positions: ~1M parameters).")
    new.add_argument("--out", required=True, help="directory to create (must not exist or be empty)")
    new.add_argument("--seed", type=int, default=0, help="weight initialization seed (default 0)")
    new.add_argument("--hidden-size", type=int, help="width of the residual stream")
    new.add_argument("--layers", type=int, help="decoder layers")
    new.add_argument("--heads", type=int, help="query heads; must divide --hidden-size into an even head size")
    new.add_argument("--kv-heads", type=int, help="key-value heads; must divide --heads")
    new.add_argument("--intermediate-size", type=int, help="MLP width")
    new.add_argument("--max-positions", type=int, help="context length in tokens")
    new.add_argument("--vl", action="store_true",
                     help="a Qwen2-VL vision-language model instead (the same language model sizes, a 2-block "
                     "vision tower, 32x32 images as 16 image tokens, and its image processor)")
    new.add_argument("--rope-theta", type=float,
                     help="with --vl: the language model's rotary base (default 1e6, the bundled tiny-vl's); 100 "
                     "lets it tell an image's columns apart, which a board needs (docs/vlm.md)")
    new.set_defaults(handler=_new_model)
    from rollflow.envs.play import add_play_parser  # `rollflow env play ENV_ID`

    add_play_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after flags (`train cfg.yaml --print-config a.b=c`); argparse leaves those over.
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from rollflow.errors import RollflowError
    from rollflow.pipelines.interrupts import Interrupted

    try:
        return args.handler(args)
    except RollflowError as err:  # user errors exit 2, run-time failures (a dead worker, a stall) exit 1
        exit_code = getattr(err, "exit_code", EXIT_USER_ERROR)
        if exit_code == 0:  # nothing to do (a resumed run that already finished): a note, not an error
            print(err)
            return 0
        print(f"rollflow: error: {_remote_cause(err)}", file=sys.stderr)
        return exit_code
    except Interrupted as err:
        print(f"rollflow: interrupted ({err.signal_name})", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt:
        print("rollflow: interrupted", file=sys.stderr)
        return 130
    finally:  # a Ray `_prestart_ray` started that no pipeline took over (a bad config, say)
        prestart = sys.modules.get("rollflow.cluster.prestart")
        if prestart is not None:
            prestart.discard_prestarted_ray()


if __name__ == "__main__":
    sys.exit(main())
