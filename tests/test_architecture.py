"""The import rules of docs/architecture.md, checked on every `import` in rollflow/ (function-level ones
included; `if TYPE_CHECKING:` blocks excluded, they never run).

The layering is read from the doc's table ("What each package may import"), so the table cannot drift from
what this test enforces. And no two modules (files) import each other, directly or around a loop.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rollflow"
DOC = ROOT / "docs" / "architecture.md"
TABLE_HEADING = "### What each package may import"

MODULES = sorted(PACKAGE.rglob("*.py"))


def _unit(path: Path) -> str:
    """The layer a module belongs to: its top-level package, or the module itself (cli, config, ...)."""
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


LAYERS = {_unit(path) for path in MODULES}


# ---------------------------------------------------------------------------------------------------------
# The table in the doc.


def _cell_names(cell: str, layers: set[str], row: str) -> set[str]:
    """The packages a cell names: `names` in backticks outside parentheses (parentheses hold notes).

    A cell naming none says `nothing`; any other word outside backticks and notes is an error, so that a
    phrase like "everything above except `rollout`" cannot silently mean something else than it says.
    """
    text = cell
    while (without_notes := re.sub(r"\([^()]*\)", "", text)) != text:  # innermost notes first
        text = without_notes
    names = set(re.findall(r"`([^`]+)`", text))
    rest = re.sub(r"[\s,]", "", re.sub(r"`[^`]+`", "", text))
    if rest != ("" if names else "nothing"):
        raise ValueError(
            f"row {row!r}: a cell is package names in backticks, separated by commas, or `nothing`, notes in "
            f"parentheses; found {rest!r} outside them"
        )
    unknown = names - layers
    if unknown:
        raise ValueError(f"row {row!r}: {sorted(unknown)} is not a package of rollflow/ ({sorted(layers)})")
    return names


def read_import_table(markdown: str, layers: set[str]) -> dict[str, set[str]]:
    """The table under `TABLE_HEADING`: each package -> the rollflow packages it may import.

    Args:
        markdown: the doc's text.
        layers: the packages that exist (a name outside them fails).

    Returns:
        One entry per package named in a first column.

    Raises:
        ValueError: no table, a malformed cell, an unknown package, or a package in two rows.
    """
    _, found, after = markdown.partition(TABLE_HEADING)
    if not found:
        raise ValueError(f"no {TABLE_HEADING!r} section")
    lines = after.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        raise ValueError(f"no table under {TABLE_HEADING!r}")
    rows = []
    for line in lines[start + 2 :]:  # after the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append(line)
    allowed: dict[str, set[str]] = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != 2:
            raise ValueError(f"row {row!r}: expected two columns, found {len(cells)}")
        packages, imports = (_cell_names(cell, layers, row) for cell in cells)
        if not packages:
            raise ValueError(f"row {row!r} names no package")
        for package in packages:
            if package in allowed:
                raise ValueError(f"row {row!r}: {package!r} has a row already")
            allowed[package] = imports
    return allowed


@functools.cache
def allowed_imports() -> dict[str, set[str]]:
    return read_import_table(DOC.read_text(), LAYERS)


def test_the_table_has_a_row_for_every_layer():
    table = allowed_imports()
    assert set(table) == LAYERS, f"docs/architecture.md's table misses rows for {sorted(LAYERS - set(table))}"


def test_the_table_reader_refuses_what_it_cannot_check():
    """A row naming an unknown package, a package twice, or words instead of names fails."""
    head = f"{TABLE_HEADING}\n\n| package | may import |\n|---|---|\n"
    layers = {"data", "engines", "models", "rewards"}
    table = read_import_table(
        head + "| `rewards` (its judge runs on `data`) | `engines` (the LLM judge's), `models` |\n"
        "| `data`, `models` | nothing (standard library only) |\n\nafter the table `data` | `x` |\n",
        layers,
    )
    assert table == {"rewards": {"engines", "models"}, "data": set(), "models": set()}
    with pytest.raises(ValueError, match="gadgets"):
        read_import_table(head + "| `rewards`, `gadgets` | `engines` |\n", layers)
    with pytest.raises(ValueError, match="gadgets"):
        read_import_table(head + "| `rewards` | `engines`, `gadgets` |\n", layers)
    with pytest.raises(ValueError, match="has a row already"):
        read_import_table(head + "| `rewards` | `engines` |\n| `rewards` | `models` |\n", layers)
    with pytest.raises(ValueError, match="everythingaboveexcept"):
        read_import_table(head + "| `rewards` | everything above except `data` |\n", layers)
    with pytest.raises(ValueError, match="outside them"):
        read_import_table(head + "| `rewards` |  |\n", layers)


# ---------------------------------------------------------------------------------------------------------
# What the modules import.


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules(package: Path) -> frozenset[str]:
    return frozenset(_module_name(path, package) for path in package.rglob("*.py"))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines.update(n.lineno for n in ast.walk(node) if hasattr(n, "lineno"))
    return lines


def _imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, imported rollflow module) of every import in the module, at any depth.

    `from rollflow.x import name` is the module `rollflow.x.name` when that is a file, else `rollflow.x`
    (its `__init__`); `import rollflow.x.y` is `rollflow.x.y`. Relative imports are resolved the same way.
    """
    modules = _modules(package)
    tree = ast.parse(path.read_text())
    skipped = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                own = _module_name(path, package).split(".")
                own_package = own if path.name == "__init__.py" else own[:-1]
                parent = own_package[: len(own_package) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((node.lineno, submodule if submodule in modules else base))
    return [(line, name) for line, name in found if name.split(".")[0] == package.name]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_the_layers_below_it(path):
    unit, allowed = _unit(path), allowed_imports()
    wrong = [f"line {line}: {module}" for line, module in _imports(path)
             if _layer(module) != unit and _layer(module) not in allowed[unit]]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({unit}) may import only {sorted(allowed[unit])}: {wrong}"


def test_the_checker_sees_function_level_imports(tmp_path):
    """The rule is about every import, not only the ones at the top of a file."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from rollflow.workers.roles import start_roles\n")
    assert [(line, _layer(name)) for line, name in _imports(module)] == [(2, "workers")]


# ---------------------------------------------------------------------------------------------------------
# No cycles between files.


def _module_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a module importing itself is no edge)."""
    graph = {}
    for path in sorted(package.rglob("*.py")):
        name = _module_name(path, package)
        graph[name] = {module for _, module in _imports(path, package) if module != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle, as a path `[a, b, ..., a]`, per strongly connected component of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(component, graph) for component in components]


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    for node in queue:  # breadth first
        for target in sorted(graph[node] & members):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                queue.append(target)
    raise AssertionError(f"{component} is not strongly connected")


def test_no_module_imports_itself_around_a_loop():
    cycles = _cycles(_module_graph(PACKAGE))
    assert not cycles, "import cycles between files:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_sees_function_level_and_from_imports(tmp_path):
    package = tmp_path / "rollflow"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from rollflow.lonely import thing\n")
    (package / "a.py").write_text("def f():\n    from rollflow.sub import b\n")  # the module sub.b
    (package / "sub" / "b.py").write_text("import rollflow.a\nfrom rollflow.sub import helper\n")  # sub/__init__
    (package / "lonely.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollflow.sub import b\n"
    )
    graph = _module_graph(package)
    assert graph["rollflow.sub.b"] == {"rollflow.a", "rollflow.sub"}
    assert graph["rollflow.lonely"] == set()
    assert _cycles(graph) == [["rollflow.a", "rollflow.sub.b", "rollflow.a"]]
