"""`rollflow` command line: train, eval, build-tiny-model.

User errors (bad config, missing files, unloadable reward) print one line and exit with status 2; a run that
fails at run time (a dead or stalled worker, non-finite training) prints one line and exits with status 1; a
stop signal exits with 130 (SIGINT) or 143 (SIGTERM) after saving the last finished step.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_USER_ERROR = 2


def _train(args: argparse.Namespace) -> int:
    """Run the pipeline the config names (`pipeline:`, default rlvr) through `rollflow.pipelines.PIPELINES`."""
    from rollflow.config import dump_config, load_config
    from rollflow.errors import RollflowError
    from rollflow.pipelines import PIPELINES

    config = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_config(config), end="")
        return 0
    pipeline = PIPELINES.get(config.pipeline)
    if args.print_plan:
        from rollflow.workers.roles import describe_plan

        print(describe_plan(config, pipeline.roles_of(config)))
        return 0
    try:
        final = pipeline.runner()(config)
    except RollflowError as err:
        _keep_worker_traceback(err, config.run_dir)
        raise
    print(f"run directory: {config.run_dir}")
    return 0 if final else 1


def _keep_worker_traceback(err: BaseException, run_dir) -> None:
    """A worker's full traceback (`WorkerError.details`) goes to `run_dir/error.log`; the one-line message
    says where."""
    details = getattr(err, "details", "")
    if not details or not run_dir.is_dir():
        return
    path = run_dir / "error.log"
    try:
        path.write_text(details)
    except OSError:
        return
    err.args = (f"{err} (worker traceback: {path})",)


def _eval(args: argparse.Namespace) -> int:
    from rollflow.config import load_config

    overrides = [f"model.path={args.model}", "train.steps=1", f"name={args.name}", *args.overrides]
    if args.data:
        overrides += [f"data.eval.path={args.data}"]
    config = load_config(args.config, overrides)
    from rollflow.pipelines.evaluate import run_eval

    metrics = run_eval(config)
    for key, value in sorted(metrics.items()):
        print(f"{key}: {value:.4g}")
    return 0


def _build_tiny_model(args: argparse.Namespace) -> int:
    from rollflow.pipelines.build_tiny_model import main as build_main

    return build_main(args.rest)


def _remote_cause(err: BaseException) -> BaseException:
    """The worker's own exception when `err` came out of a Ray actor (whose message is a whole traceback)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) and type(err).__name__.startswith("RayTaskError") else err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollflow", description="RL post-training for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run the pipeline a YAML config names (+ key.path=value overrides)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="overrides like rollout.prompts_per_step=8")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument("--print-plan", action="store_true",
                       help="print which worker of which role sits on which device and node, and exit")
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser("eval", help="greedy accuracy of a model on an eval dataset")
    evaluate.add_argument("--model", required=True, help="bundled name, HF directory, checkpoint or hub id")
    evaluate.add_argument("--config", default=None, help="YAML config for data/reward settings")
    evaluate.add_argument("--data", default=None, help="JSONL eval dataset (default: the config's eval set)")
    evaluate.add_argument("--name", default="eval", help="run name for the output directory")
    evaluate.add_argument("overrides", nargs="*", help="config overrides like data.eval.limit=500")
    evaluate.set_defaults(handler=_eval)

    build = commands.add_parser("build-tiny-model", help="rebuild the bundled tiny model (SFT from scratch)",
                                add_help=False)
    build.add_argument("rest", nargs=argparse.REMAINDER)
    build.set_defaults(handler=_build_tiny_model)
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
        print(f"rollflow: error: {_remote_cause(err)}", file=sys.stderr)
        return getattr(err, "exit_code", EXIT_USER_ERROR)
    except Interrupted as err:
        print(f"rollflow: interrupted ({err.signal_name})", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt:
        print("rollflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
