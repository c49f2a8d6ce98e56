"""Name -> implementation registries (losses, advantages, engines, backends, envs, rewards).

Plain Python that imports only `rollflow.errors` from the rest of rollflow, so every folder may use it.

A registry whose implementations need torch can be filled lazily: made with `declared_in` (the modules whose
functions register into it with `@NAME.register("x")`), it knows its names and each function's options from
those modules' source (read with `ast`, not imported), and imports a module only when one of its names is
looked up (`get`). So the config loads and checks algorithm names and options without importing torch.

The one
exception runs only when called, for the docs: `find_registries` imports the package's modules by name to map
every registry, and `python -m rollflow.registry docs/architecture.md` rewrites the doc's table of them
(`render_registry_table`; `tests/docs/test_architecture_map.py` checks that the committed table is the one
rendered).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

from rollflow.errors import ConfigError, RollflowError

T = TypeVar("T")


class UnknownNameError(RollflowError, KeyError):
    """An unknown registry name. The message lists the valid names and the nearest match."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0])


@dataclass(frozen=True)
class Options:
    """The options (keyword arguments a config may pass) of a registered function.

    Attributes:
        names: keyword-only parameters and positional ones with a default, sorted.
        required: keyword-only parameters without a default.
        any: it takes `**kwargs` (every option is accepted).
    """

    names: tuple[str, ...]
    required: tuple[str, ...] = ()
    any: bool = False

    @classmethod
    def of(cls, fn: Callable[..., object]) -> Options:
        """The options of a function (its signature)."""
        names, required, any_ = [], [], False
        for param in inspect.signature(fn).parameters.values():
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                names.append(param.name)
                if param.default is param.empty:
                    required.append(param.name)
            elif param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and param.default is not param.empty:
                names.append(param.name)
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                any_ = True
        return cls(tuple(sorted(names)), tuple(required), any_)

    @classmethod
    def from_source(cls, function: ast.FunctionDef | ast.AsyncFunctionDef) -> Options:
        """The options of a function as its source defines it (`Options.of` without importing it)."""
        arguments = function.args
        positional = [*arguments.posonlyargs, *arguments.args]
        with_default = [arg.arg for arg in positional[len(positional) - len(arguments.defaults):]
                        if arg not in arguments.posonlyargs] if arguments.defaults else []
        keyword_only = [arg.arg for arg in arguments.kwonlyargs]
        required = [arg.arg for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
                    if default is None]
        return cls(tuple(sorted(with_default + keyword_only)), tuple(required), arguments.kwarg is not None)


@dataclass(frozen=True)
class Declared:
    """A name that a module registers with `@NAME.register("x")`, read from the module's source.

    Attributes:
        module: the module that registers it (imported on the name's first `get`).
        function: the decorated function's name in that module.
        options: the function's options, from its signature in the source.
    """

    module: str
    function: str
    options: Options


class Registry(Generic[T]):
    """A named collection of implementations.

    Args:
        kind: what the registry holds, used in error messages ("advantage estimator").
        declared_in: modules that register into it, read (not imported) for the names they declare: a name
            declared there is known at once and its module imported on the name's first `get`.
        declared_as: the name the modules' decorators call the registry by (`POLICY_LOSSES` in
            `@POLICY_LOSSES.register("ppo")`); needed with `declared_in`.
    """

    def __init__(self, kind: str, *, declared_in: tuple[str, ...] = (), declared_as: str | None = None):
        if declared_in and not declared_as:
            raise ValueError("a registry declared in modules needs `declared_as`: the name its decorators use")
        self.kind = kind
        self._entries: dict[str, T] = {}
        self.declared_in = declared_in
        self.declared_as = declared_as
        self._declarations: dict[str, Declared] | None = None  # read on first use

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers `obj` under `name`; a duplicate name is an error."""

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the implementation for `name` (importing the module that declares it, the first time), or
        raise `UnknownNameError` naming the valid ones."""
        if name not in self._entries and name in self.declarations():
            declared = self.declarations()[name]
            importlib.import_module(declared.module)  # its decorator registers the name
            if name not in self._entries:
                raise RuntimeError(f"{self.kind} {name!r}: {declared.module} declares it in its source but did "
                                   "not register it when imported")
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def registered(self) -> dict[str, T]:
        """The implementations registered so far, by name (a declared module not yet imported has none here)."""
        return dict(self._entries)

    def options(self, name: str) -> Options:
        """The options of `name`'s implementation: from its signature once imported, else from its source."""
        if name in self._entries:
            return Options.of(self._entries[name])  # type: ignore[arg-type]
        if name in self.declarations():
            return self.declarations()[name].options
        raise UnknownNameError(self.unknown_message(name))

    def declarations(self) -> dict[str, Declared]:
        """The names `declared_in` register, read from their source once."""
        if self._declarations is None:
            self._declarations = {}
            for module in self.declared_in:
                for name, declared in declared_names(module, self.declared_as or "").items():
                    if name in self._declarations:
                        raise ValueError(f"{self.kind} {name!r} is declared twice: in "
                                         f"{self._declarations[name].module} and {module}")
                    self._declarations[name] = declared
        return self._declarations

    def unknown_message(self, name: str) -> str:
        valid = self.names()
        near = difflib.get_close_matches(name, valid, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        return f"unknown {self.kind} {name!r}.{hint} Valid: {', '.join(valid)}"

    def names(self) -> list[str]:
        return sorted({*self._entries, *self.declarations()})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self.declarations()

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def _module_source(module: str) -> ast.Module:
    """`module`'s source, parsed; the module is not imported (one of this package is found under the package's
    directory, any other by `importlib.util.find_spec`, which imports its parent packages)."""
    root = Path(__file__).resolve().parent
    package, _, rest = module.partition(".")
    if package == root.name:
        base = root.joinpath(*rest.split(".")) if rest else root
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    else:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no module named {module!r}", name=module)
        path = Path(spec.origin)
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def source_definition(spec: str) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None:
    """The top-level function or class `module:name` names, as its module's source defines it (not imported);
    None when the source does not define it at top level (an alias, an import)."""
    module, _, name = spec.partition(":")
    for node in _module_source(module).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return node
    return None


def declared_names(module: str, registry_name: str) -> dict[str, Declared]:
    """The names `module`'s top-level functions register with `@<registry_name>.register("x")` (or
    `<registry_name>.register("y")(function)`), read from its source (`_module_source`)."""
    tree = _module_source(module)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}

    def registered_name(call: ast.expr) -> str | None:  # "x" of `<registry_name>.register("x")`
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "register"
                and isinstance(call.func.value, ast.Name) and call.func.value.id == registry_name and call.args
                and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
            return call.args[0].value
        return None

    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # @NAME.register("x") def f(...)
            for decorator in node.decorator_list:
                name = registered_name(decorator)
                if name is not None:
                    found[name] = Declared(module, node.name, Options.from_source(node))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):  # NAME.register("y")(f): an alias
            name = registered_name(node.value.func)
            target = node.value.args[0] if len(node.value.args) == 1 else None
            if name is not None and isinstance(target, ast.Name) and target.id in functions:
                found[name] = Declared(module, target.id, Options.from_source(functions[target.id]))
    return found


def import_module(name: str) -> ModuleType:
    """Import module `name`, searching the current working directory too, as `python -m` users expect of
    their own modules: `my_rewards:score` finds `./my_rewards.py` under the `rollflow` command, whose
    `sys.path` starts at the command's own directory. The directory is appended, so an installed package
    of the same name still wins, and stays (a user module may import its neighbours later).

    Ray workers need nothing more: a local Ray starts them in the driver's working directory, with it on
    their `sys.path`.
    """
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: nothing to add
        return importlib.import_module(name)
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.append(cwd)
    return importlib.import_module(name)


def import_object(spec: str):
    """Import `package.module:attribute` and return the attribute (a user module may sit in the current
    working directory: `import_module`)."""
    module_name, _, attribute = spec.partition(":")
    return getattr(import_module(module_name), attribute)


def import_factory(spec: str, kind: str) -> Callable:
    """The callable `module:attribute` names, for a user's own env, tool, ... given by dotted path (the module
    may sit in the working directory: `import_module`).

    Args:
        spec: `pkg.module:attribute`.
        kind: what it names, for the errors ("env", "tool").

    Raises:
        ConfigError: the path is malformed, the module fails to import (missing, a syntax error, an exception
            at import: the user's module's problem, said in one line), or the attribute is missing or not
            callable.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{kind} {spec!r} is not of the form 'pkg.module:factory'")
    try:
        module = import_module(module_name)
    except Exception as err:  # noqa: BLE001  (anything raised at import is the user module's problem)
        reason = _one_line(err)
        if isinstance(err, SyntaxError) and err.lineno is not None:
            reason += f" ({err.filename}, line {err.lineno})"
        if isinstance(err, ModuleNotFoundError) and err.name == module_name.split(".")[0]:
            reason += f"; looked on sys.path and in the working directory {os.getcwd()}"
        raise ConfigError(f"{kind} {spec!r}: cannot import module {module_name!r} ({reason})") from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise ConfigError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise ConfigError(f"{kind} {spec!r}: {attribute!r} is not callable")
    return factory


def _one_line(err: BaseException) -> str:
    """`Type: first line of the message` (a SyntaxError's own message, without its file and line)."""
    text = err.msg if isinstance(err, SyntaxError) and err.msg else str(err)
    lines = text.strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


# ---------------------------------------------------------------------------------------------------------
# The map of every registry (docs/architecture.md).

REGENERATE = "python -m rollflow.registry docs/architecture.md"
TABLE_START = f"<!-- Generated from the registries by `{REGENERATE}`; edit the registries, not this table. -->"
TABLE_END = "<!-- End of the generated registry table. -->"
# What a module's source says when it makes a registry or registers a name in one; modules that say neither
# are not imported (most of the package's import time is theirs: transformers' models, Ray).
_MAKES_OR_FILLS = re.compile(r"=\s*Registry\b|\.register\(")


@dataclass(frozen=True)
class FoundRegistry:
    """A module-level `Registry` and where it is made.

    Attributes:
        name: the variable that holds it (`ENVS`).
        module: the module that assigns it from `Registry(...)` (`rollflow.envs.base`); modules that import it
            from there are not named.
        registry: the registry, with every name the package's modules register.
    """

    name: str
    module: str
    registry: Registry


def find_registries(package: str = "rollflow") -> list[FoundRegistry]:
    """Every module-level `Registry` of `package`, once each, under the module that makes it.

    Walks the package's modules with `pkgutil` (reading their files, importing no package for the walk) and
    imports those whose source makes a registry (`X = Registry(...)`) or registers a name in one
    (`.register(`): a registry holds a name once the module that registers it is imported.
    A module that needs a package not installed (vllm, sglang, gem, mcp) is skipped; the names it would
    register are then missing from its registry.

    Returns:
        Sorted by module, then name.

    Raises:
        ImportError: a module of `package` itself is missing (a broken tree, not an optional package).
        ValueError: a registry whose making no module's source shows as `NAME = Registry(...)`.
    """
    sources = {name: path.read_text(encoding="utf-8") for name, path in _module_files(package)}
    modules = []
    for name in sorted(sources):
        if not _MAKES_OR_FILLS.search(sources[name]):
            continue
        try:
            modules.append(importlib.import_module(name))
        except ImportError as err:
            if err.name and err.name.partition(".")[0] == package:
                raise
    found: dict[int, FoundRegistry] = {}
    held: dict[int, str] = {}  # every registry a module holds -> the first `module.NAME` seen holding it
    for module in modules:
        for attribute, value in vars(module).items():
            if not isinstance(value, Registry):
                continue
            held.setdefault(id(value), f"{module.__name__}.{attribute}")
            made_here = rf"^{re.escape(attribute)}\s*(:[^=\n]*)?=\s*Registry\b"
            if re.search(made_here, sources[module.__name__], re.MULTILINE):
                found.setdefault(id(value), FoundRegistry(attribute, module.__name__, value))
    unplaced = sorted(where for key, where in held.items() if key not in found)
    if unplaced:
        raise ValueError(f"registries whose module does not make them as `NAME = Registry(...)`: {unplaced}")
    return sorted(found.values(), key=lambda entry: (entry.module, entry.name))


def _module_files(package: str) -> list[tuple[str, Path]]:
    """(`a.b.c`, its .py file) for `package` and every module under it, found without importing any."""
    root = Path(importlib.util.find_spec(package).origin).parent
    files = [(package, root / "__init__.py")]
    pending = [(root, package)]
    while pending:
        directory, prefix = pending.pop()
        for info in pkgutil.iter_modules([str(directory)], prefix + "."):
            leaf = info.name.rpartition(".")[2]
            if info.ispkg:
                files.append((info.name, directory / leaf / "__init__.py"))
                pending.append((directory / leaf, info.name))
            else:
                files.append((info.name, directory / f"{leaf}.py"))
    return files


def render_registry_table(registries: list[FoundRegistry] | None = None) -> str:
    """The Markdown table of every registry: its name, module, what it holds (its `kind`) and its names.

    Args:
        registries: what to list; default `find_registries()`.

    Returns:
        The table, one row per registry, ending in a newline.
    """
    registries = find_registries() if registries is None else registries
    rows = ["| registry | module | holds | names |", "|---|---|---|---|"]
    for entry in registries:
        names = ", ".join(f"`{name}`" for name in entry.registry.names()).replace("|", "\\|")
        rows.append(f"| `{entry.name}` | `{entry.module}` | {entry.registry.kind} | {names} |")
    return "\n".join(rows) + "\n"


def with_registry_table(markdown: str, table: str) -> str:
    """`markdown` with what lies between `TABLE_START` and `TABLE_END` replaced by `table`.

    Raises:
        ValueError: either marker missing, or out of order.
    """
    start, end = markdown.find(TABLE_START), markdown.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"no {TABLE_START!r} ... {TABLE_END!r} block to put the registry table in")
    return markdown[:start + len(TABLE_START)] + "\n\n" + table + "\n" + markdown[end:]


def generated_doc_main(argv: list[str] | None, regenerate: str, render: Callable[[], str],
                       into: Callable[[str, str], str] | None = None) -> int:
    """The `main` of a doc generator (`regenerate` is its command line, ending in the doc's path): with no
    argument print what `render()` makes; with a path write it there, or with `into(the file's text,
    rendered)` put it inside the file. Two or more arguments, or a file `into` refuses (ValueError), is one line
    on stderr and status 2."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        print(f"usage: {regenerate.rsplit(' ', 1)[0]} [PATH]", file=sys.stderr)
        return 2
    text = render()
    if not argv:
        sys.stdout.write(text)
        return 0
    path = Path(argv[0])
    if into is not None:
        try:
            text = into(path.read_text(encoding="utf-8"), text)
        except ValueError as err:
            print(f"{path}: {err}", file=sys.stderr)
            return 2
    path.write_text(text, encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Rewrite the registry table in the file given (docs/architecture.md), or print the table when none is."""
    return generated_doc_main(argv, REGENERATE, render_registry_table, with_registry_table)


if __name__ == "__main__":
    # `python -m` runs this file as `__main__`, whose `Registry` is not the class the package's registries are
    # made of: run the imported module's `main`.
    from rollflow.registry import main as registry_main

    sys.exit(registry_main())
