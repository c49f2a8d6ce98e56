"""The import layering of docs/architecture.md, checked on every `import` in rollflow/ (function-level ones
included; `if TYPE_CHECKING:` blocks excluded, they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rollflow"

BASE = {"errors", "registry", "spans"}
ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "errors": set(),
    "spans": set(),
    "registry": {"errors"},
    "algorithms": BASE,
    "data": BASE,
    "models": BASE,
    "fresh_model": BASE | {"data"},
    "envs": BASE | {"data", "rewards"},
    "assets": set(),
    "backends": BASE | {"algorithms", "data", "models"},
    "engines": BASE | {"models"},
    "rewards": BASE | {"engines", "models"},
    "config": BASE | {"algorithms", "backends", "engines", "envs"},
    "trackers": BASE | {"data"},
    "cluster": BASE | {"data"},
    "rollout": BASE | {"algorithms", "cluster", "data", "engines", "rewards"},
    "workers": BASE | {"algorithms", "data", "models", "backends", "engines", "rewards", "config", "cluster",
                       "envs"},
    "pipelines": BASE | {"algorithms", "data", "models", "backends", "engines", "rewards", "config", "cluster",
                         "trackers", "rollout", "workers", "fresh_model"},
    "cli": BASE | {"cluster", "config", "pipelines", "workers", "fresh_model", "envs"},  # cluster: prestart_ray
}


def _unit(path: Path) -> str:
    """The layer a module belongs to: its top-level package, or the module itself (cli, config, ...)."""
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines.update(n.lineno for n in ast.walk(node) if hasattr(n, "lineno"))
    return lines


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported rollflow layer) of every import in the module."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rollflow" and len(parts) > 1 and node.lineno not in skipped:
                found.append((node.lineno, parts[1]))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_layer_is_in_the_table():
    assert {_unit(path) for path in MODULES} <= set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_the_layers_below_it(path):
    unit = _unit(path)
    wrong = [f"line {line}: rollflow.{target}" for line, target in _imports(path)
             if target != unit and target not in ALLOWED[unit]]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({unit}) may import only {sorted(ALLOWED[unit])}: {wrong}"


def test_the_checker_sees_function_level_imports(tmp_path):
    """The rule is about every import, not only the ones at the top of a file."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from rollflow.workers.roles import start_roles\n")
    assert _imports(module) == [(2, "workers")]
