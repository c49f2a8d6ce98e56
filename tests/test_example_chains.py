"""The command chains the examples' header comments give (`#   rollflow sft ...`, `#   python make_data.py
--out ...`, `Run: rollflow train ...`) run as written: every command parses, every config loads through the
CLI (`--print-config`), and every model, reference or data path a config reads that a documented command
writes is exactly the path that command writes, written by an earlier command of its own chain or by
another example's documented command (distill.yaml's teacher is the quickstart's final checkpoint).

What a command writes:
* `rollflow train|sft|dpo|distill CONFIG [overrides]`: `output.dir/name/checkpoints/step_<final>/model`,
  the checkpoint every pipeline saves after its last step (`train.steps`, or `train.epochs` x full batches;
  unknown in advance under `train.stop_at_accuracy` or `train.early_stopping_patience`), and with
  `train.best_checkpoint_metric` `checkpoints/best/model`,
* `rollflow new-model --out DIR`, `rollflow build-tiny-model --out DIR`: DIR,
* `python examples/.../make_*.py --out DIR`: the files the script writes there (run here, into tmp_path).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from rollflow.cli import build_parser, main
from rollflow.models import BUNDLED_MODELS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
PIPELINE_COMMANDS = ("train", "sft", "dpo", "distill")
# A documented command: an indented `#   rollflow ...` / `#   python ...` line, or `Run: rollflow ...` in prose.
COMMAND_LINE = re.compile(r"^#\s{2,}((?:rollflow|python)\s.*)$|Run:\s+(rollflow\s.*)$")
# What follows a command on its line: a `# comment`, or a `(remark)` set off by two spaces or more.
REMARK = re.compile(r"\s+#.*$|\s{2,}\(.*$")
PATH_KEYS = ("path", "model_path")  # config keys naming a model or a data file (model.path, data.*.path, ...)


class Command(NamedTuple):
    example: str  # the YAML whose header documents it, relative to the repository root
    argv: tuple[str, ...]  # as a shell splits it, `rollflow`/`python` first

    def __str__(self) -> str:
        return shlex.join(self.argv)


def header_commands(example: Path) -> list[Command]:
    """The commands of `example`'s leading comment block, in order."""
    commands = []
    for line in example.read_text().splitlines():
        if not line.startswith("#"):
            break
        if found := COMMAND_LINE.search(line):
            text = REMARK.sub("", found.group(1) or found.group(2))
            commands.append(Command(str(example.relative_to(ROOT)), tuple(shlex.split(text))))
    return commands


def resolved_config(command: Command) -> dict[str, Any]:
    """The config a `rollflow <pipeline> CONFIG [overrides]` command runs, as `--print-config` prints it (the
    CLI's own parsing, `pipeline` check and validation). Fails the test when the CLI refuses it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*command.argv[1:], "--print-config"])
        except SystemExit as exit_info:  # argparse refusing the arguments
            code = exit_info.code
    assert code == 0, f"{command.example}: `{command} --print-config` failed: {err.getvalue().strip()}"
    return yaml.safe_load(out.getvalue())


def needed_paths(config: dict[str, Any]) -> list[str]:
    """Every model path, reference model path and data file path the config reads."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in PATH_KEYS and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return [path for path in found if path not in BUNDLED_MODELS]


def final_step(config: dict[str, Any], data_files: dict[str, Path]) -> int | None:
    """The step of the last checkpoint a run of `config` saves; None when it is not known in advance."""
    train = config["train"]
    if train.get("stop_at_accuracy") is not None or train.get("early_stopping_patience") is not None:
        return None  # the run ends at an eval: the first to reach the accuracy, or the last of a plateau
    if train.get("epochs") is None:
        return train["steps"]
    source = config["data"]["train"]  # epochs x full batches (`supervised.with_resolved_steps`)
    if source.get("path") is None:
        from rollflow.data.arithmetic import arithmetic_splits

        rows = len(arithmetic_splits(source["task"], seed=0)[0])
    elif str(Path(source["path"])) in data_files:
        rows = len(data_files[str(Path(source["path"]))].read_text().splitlines())
    else:
        return None
    return train["epochs"] * (rows // train["batch_size"])


def out_dir(command: Command) -> str | None:
    """The `--out DIR` of a command, None without one."""
    argv = command.argv
    for index, arg in enumerate(argv):
        if arg == "--out" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--out="):
            return arg.removeprefix("--out=")
    return None


def run_script(command: Command, workdir: Path) -> subprocess.Popen:
    """Start a documented `python examples/....py --out DIR` in `workdir`, so DIR lands there."""
    script = ROOT / command.argv[1]
    assert script.is_file(), f"{command.example}: `{command}`: no script {command.argv[1]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(script), *command.argv[2:]], cwd=workdir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class Documented(NamedTuple):
    """What the documented commands write: path -> the commands that write it (several examples may document
    the same one), and the files the data scripts wrote here, by the path a config names them with."""

    writes: dict[str, list[Command]]
    data_files: dict[str, Path]
    configs: dict[Command, dict[str, Any]]

    def writers(self, path: str) -> list[Command]:
        return self.writes.get(str(Path(path)), [])


def what_commands_write(commands: list[Command], workdir: Path) -> Documented:
    """Run the data scripts (into `workdir`), resolve every pipeline command's config, and collect the paths
    each command writes."""
    writes: dict[str, list[Command]] = {}
    data_files: dict[str, Path] = {}
    scripts = {}
    for command in commands:  # the scripts run side by side while the configs load
        if command.argv[0] == "python" and out_dir(command) and command.argv not in scripts:
            scripts[command.argv] = (command, run_script(command, workdir))
    configs = {}
    for command in commands:
        if command.argv[0] == "rollflow" and len(command.argv) > 1 and command.argv[1] in PIPELINE_COMMANDS:
            configs[command] = resolved_config(command)
    for command, process in scripts.values():
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"{command.example}: `{command}` failed:\n{err}"
        out = out_dir(command)
        for file in sorted((workdir / out).rglob("*")):
            if file.is_file():
                name = str(Path(out) / file.relative_to(workdir / out))
                data_files[name] = file
    for command in commands:
        for path in outputs(command, configs.get(command), data_files):
            writes.setdefault(str(Path(path)), []).append(command)
    return Documented(writes, data_files, configs)


def outputs(command: Command, config: dict[str, Any] | None, data_files: dict[str, Path]) -> list[str]:
    """The paths `command` writes that a config may read (see the module docstring)."""
    argv = command.argv
    if argv[0] == "python":
        out = out_dir(command)
        return [name for name in data_files if out and Path(name).is_relative_to(out)]
    if argv[1] in ("new-model", "build-tiny-model"):
        args = build_parser().parse_args(argv[1:])
        return [args.out]
    if config is not None:
        checkpoints = Path(config["output"]["dir"]) / config["name"] / "checkpoints"
        step = final_step(config, data_files)
        written = [checkpoints / (f"step_{step}" if step is not None else "step_?") / "model"]
        if config["train"].get("best_checkpoint_metric") is not None:  # SFT: the best validation eval's too
            written.append(checkpoints / "best" / "model")
        return [str(path) for path in written]
    return []


def chain_problems(example: str, commands: list[Command], documented: Documented) -> list[str]:
    """What in `example`'s chain does not run as written: a path a config reads that no documented command
    writes (naming what the commands writing into that run or directory write instead), or that a command of
    the chain writes only after the command reading it."""
    problems = []
    writes_in_chain = [{str(Path(path)) for path in outputs(c, documented.configs.get(c), documented.data_files)}
                       for c in commands]
    for index, command in enumerate(commands):
        config = documented.configs.get(command)
        if config is None:
            continue
        for path in map(str, map(Path, needed_paths(config))):
            if not documented.writers(path):
                if _place(path)[:1] not in {_place(written)[:1] for written in documented.writes}:
                    continue  # not where documented commands write (`runs/`, `data/`): a hub id, the user's own
                instead = [f"`{writer}` ({writer.example}) writes {written}"
                           for written, writers in documented.writes.items() if _place(written) == _place(path)
                           for writer in writers]
                problems.append(f"{example}: `{command}` reads {path}, which no documented command writes"
                                + "".join(f"; {line}" for line in instead))
                continue
            writer_indices = [i for i, written in enumerate(writes_in_chain) if path in written]
            if writer_indices and min(writer_indices) > index:
                problems.append(f"{example}: `{command}` reads {path} before "
                                f"`{commands[min(writer_indices)]}` writes it")
    return problems


def _place(path: str) -> tuple[str, ...]:
    """Where a path lies: its run directory for a checkpoint (`runs/quickstart`), else its directory."""
    parts = Path(path).parts
    return parts[:parts.index("checkpoints")] if "checkpoints" in parts else parts[:-1]


@pytest.fixture(scope="module")
def documented(tmp_path_factory) -> Documented:
    cwd = os.getcwd()
    os.chdir(ROOT)  # the commands are written to run from the repository root
    try:
        commands = [command for example in EXAMPLES for command in header_commands(example)]
        return what_commands_write(commands, tmp_path_factory.mktemp("chains"))
    finally:
        os.chdir(cwd)


@pytest.fixture(autouse=True)
def _at_the_repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_every_example_documents_a_command_that_runs_it():
    for example in EXAMPLES:
        commands = header_commands(example)
        runs_itself = [c for c in commands if c.argv[0] == "rollflow" and str(example.relative_to(ROOT)) in c.argv]
        assert runs_itself, f"{example.relative_to(ROOT)}: its header documents no command that runs it"


def test_every_documented_command_parses():
    parser = build_parser()
    for example in EXAMPLES:
        for command in header_commands(example):
            if command.argv[0] == "python":
                assert (ROOT / command.argv[1]).is_file(), f"{command.example}: `{command}`: no such script"
                continue
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    parser.parse_args(command.argv[1:])
                except SystemExit:
                    pytest.fail(f"{command.example}: `{command}`: {err.getvalue().strip()}")


@pytest.mark.parametrize("example", [str(path.relative_to(ROOT)) for path in EXAMPLES])
def test_the_chain_writes_what_the_config_reads(example, documented):
    commands = header_commands(ROOT / example)
    problems = chain_problems(example, commands, documented)
    assert not problems, "\n".join(problems)


def test_a_stale_checkpoint_step_is_caught(documented):
    """distill.yaml read the quickstart's `step_100` after the quickstart grew to 120 steps (issue #27)."""
    example = "examples/distill.yaml"
    stale = Command(example, ("rollflow", "distill", example,
                              "roles.reference.model_path=runs/quickstart/checkpoints/step_100/model"))
    with_stale = documented._replace(configs={**documented.configs, stale: resolved_config(stale)})
    quickstart = Command(example, ("rollflow", "train", "examples/quickstart.yaml"))
    problems = chain_problems(example, [quickstart, stale], with_stale)
    assert len(problems) == 1
    assert "reads runs/quickstart/checkpoints/step_100/model, which no documented command writes" in problems[0]
    assert "writes runs/quickstart/checkpoints/step_120/model" in problems[0]


def test_a_command_that_reads_before_its_chain_writes_is_caught(documented):
    example = "examples/word_problems/sft.yaml"
    commands = header_commands(ROOT / example)
    make_data = next(c for c in commands if c.argv[0] == "python")
    reordered = [c for c in commands if c != make_data] + [make_data]  # the data made after the SFT run
    assert any("reads data/word_problems/train.jsonl before" in p
               for p in chain_problems(example, reordered, documented))
