"""docs/architecture.md against the code it maps, and every test path the docs name against the tests.

- The registry table is what `rollflow.registry.render_registry_table()` renders from the registries
  themselves (every module-level `Registry` in rollflow/, its module, what it holds, its names).
- The layers diagram's `cli.py` line lists exactly the commands `rollflow.cli.build_parser()` has.
- Every `tests/...py` path (and `::test_name`) in docs/*.md exists.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import re
from pathlib import Path

import pytest

from rollflow.cli import build_parser
from rollflow.registry import (
    REGENERATE,
    TABLE_END,
    TABLE_START,
    FoundRegistry,
    Registry,
    find_registries,
    main,
    render_registry_table,
    with_registry_table,
)

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))


@functools.cache
def registries() -> tuple[FoundRegistry, ...]:
    return tuple(find_registries())


# ---------------------------------------------------------------------------------------------------------
# The registry table.


def test_committed_registry_table_is_the_rendered_one():
    committed = ARCHITECTURE.read_text(encoding="utf-8")
    rendered = with_registry_table(committed, render_registry_table(list(registries())))
    diff = "\n".join(list(difflib.unified_diff(committed.splitlines(), rendered.splitlines(),
                                               "docs/architecture.md", "rendered", lineterm=""))[:40])
    if committed != rendered:
        pytest.fail(f"docs/architecture.md's registry table is not what the registries render; run "
                    f"`{REGENERATE}` and commit it.\n{diff}")


def test_the_map_names_each_registry_once_under_the_module_that_makes_it():
    found = registries()
    assert len({id(entry.registry) for entry in found}) == len(found)
    where = {entry.name: entry.module for entry in found}
    # made in one module, re-exported by others, filled by others still (frozenlake.py, calculator.py, ...)
    assert where["ENVS"] == "rollflow.envs.base" and where["TOOLS"] == "rollflow.tools.base"
    assert where["ADVANTAGE_ESTIMATORS"] == "rollflow.algorithms.registries"  # not `rollflow.algorithms`
    by_name = {entry.name: entry.registry for entry in found}
    assert {"frozenlake", "sokoban"} <= set(by_name["ENVS"].names())
    assert {"calculator", "mcp"} <= set(by_name["TOOLS"].names())


def test_no_registry_is_filled_from_inside_a_function():
    """`find_registries` imports only the modules whose source says `.register(`; that sees every name only if
    each registration runs at a module's top level (a module-level loop is fine), not in a helper that some
    other module calls at import."""
    names = {entry.name for entry in registries()}
    inside = []
    for path in sorted((ROOT / "rollflow").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if ".register(" not in source:
            continue
        tree = ast.parse(source)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for statement in function.body:  # the body only: a decorator runs at the module's level
                for node in ast.walk(statement):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr == "register" and _last_name(node.func.value) in names):
                        inside.append(f"{path.relative_to(ROOT)}:{node.lineno} ({function.name})")
    assert not inside, f"registrations inside functions, which the registry map may not see: {inside}"


def _last_name(node: ast.expr) -> str | None:
    """`ENVS` of `ENVS` or `base.ENVS`."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def test_the_table_lists_each_registry_with_its_module_kind_and_names():
    colours, sizes = Registry("colour"), Registry("size")
    colours.register("red")(1)
    colours.register("a|b")(2)
    table = render_registry_table([FoundRegistry("COLOURS", "pkg.paint", colours),
                                   FoundRegistry("SIZES", "pkg.shape", sizes)])
    assert table == ("| registry | module | holds | names |\n|---|---|---|---|\n"
                     "| `COLOURS` | `pkg.paint` | colour | `a\\|b`, `red` |\n"
                     "| `SIZES` | `pkg.shape` | size |  |\n")


def test_the_table_replaces_only_what_lies_between_the_markers(tmp_path, capsys):
    page = f"# A\n\n{TABLE_START}\nold table\n{TABLE_END}\n\nafter\n"
    assert with_registry_table(page, "| t |\n") == f"# A\n\n{TABLE_START}\n\n| t |\n\n{TABLE_END}\n\nafter\n"
    with pytest.raises(ValueError, match="no .* block"):
        with_registry_table("# A\n", "| t |\n")

    target = tmp_path / "architecture.md"
    target.write_text(page, encoding="utf-8")
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == with_registry_table(page, render_registry_table())
    assert main([]) == 0 and capsys.readouterr().out == render_registry_table()
    target.write_text("# no markers\n", encoding="utf-8")
    assert main([str(target)]) == 2 and target.read_text(encoding="utf-8") == "# no markers\n"


# ---------------------------------------------------------------------------------------------------------
# The command line in the layers diagram.


def parser_commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """Every command of `parser`, sub-commands spelled out (`env play`)."""
    commands = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                commands += parser_commands(command, f"{prefix}{name} ") or [prefix + name]
    return commands


def diagram_commands(markdown: str) -> list[str]:
    """The commands of the diagram's line `cli.py   rollflow train / sft / ... / env play`."""
    line = re.search(r"^\s*cli\.py\s+rollflow (.+)$", markdown, re.MULTILINE)
    assert line, "docs/architecture.md has no `cli.py   rollflow a / b / ...` line"
    return [command.strip() for command in line.group(1).split(" / ")]


def test_the_diagram_lists_every_command_of_the_cli():
    documented, parsed = diagram_commands(ARCHITECTURE.read_text(encoding="utf-8")), parser_commands(build_parser())
    missing = [command for command in parsed if command not in documented]
    extra = [command for command in documented if command not in parsed]
    assert not missing and not extra, (
        f"docs/architecture.md's cli.py line: missing commands {missing}, commands the CLI does not have {extra}")


def test_the_cli_check_reads_nested_commands():
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    commands.add_parser("train")
    commands.add_parser("env").add_subparsers().add_parser("play")
    assert parser_commands(parser) == ["train", "env play"]
    assert diagram_commands("```\n  cli.py      rollflow train / env play\n```") == ["train", "env play"]


# ---------------------------------------------------------------------------------------------------------
# Test paths in the docs.

TEST_PATH = re.compile(r"(?<![\w/.])(tests/[\w/.-]+?\.py)((?:::[\w\[\]-]+)*)")


def dead_test_paths(markdown: str, root: Path = ROOT) -> list[str]:
    """The `tests/...py` paths and `path::name` (`::Class::test`; a `[param]` id is left out) of `markdown`
    whose file, or whose function or class, does not exist under `root`."""
    dead = []
    for path, names in sorted(set(TEST_PATH.findall(markdown))):
        file = root / path
        if not file.is_file():
            dead.append(path + names)
            continue
        scope = ast.parse(file.read_text(encoding="utf-8")).body
        for name in (re.sub(r"\[.*\]$", "", part) for part in names.split("::")[1:]):
            node = next((node for node in scope if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                     ast.ClassDef)) and node.name == name), None)
            if node is None:
                dead.append(path + names)
                break
            scope = node.body
    return dead


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_every_test_path_a_page_names_exists(page):
    dead = dead_test_paths(page.read_text(encoding="utf-8"))
    assert not dead, (f"{page.relative_to(ROOT)} names tests that do not exist: {dead}; point it at where the "
                      "test lives now (grep tests/ for what it checks)")


def test_the_path_check_catches_a_dead_file_and_a_dead_name(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one():\n    pass\n\nclass TestB:\n"
                                                  "    def test_two(self):\n        pass\n")
    text = ("`tests/test_a.py`, `tests/test_a.py::test_one[x]`, tests/test_a.py::TestB::test_two; dead: "
            "`tests/test_gone.py`, `tests/test_a.py::test_three`, `tests/test_a.py::TestB::test_one`")
    assert dead_test_paths(text, tmp_path) == [
        "tests/test_a.py::TestB::test_one", "tests/test_a.py::test_three", "tests/test_gone.py"]
