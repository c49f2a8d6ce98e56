"""The config loads and checks without torch: every example config in a process that cannot import torch, numpy,
transformers or Ray; and the algorithm registries that make it possible (names and options read from their
modules' source) say what importing those modules registers."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.algorithms import registries
from rollflow.backends import BACKENDS, backend_class, backend_kwarg_names
from rollflow.registry import Options, Registry

REPO = Path(__file__).resolve().parents[2]

BLOCKED = """
import glob, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy", "transformers", "ray"):
            raise ImportError(f"the config imported {name}")

sys.meta_path.insert(0, Blocked())
from rollflow.config import load_config
from rollflow.errors import ConfigError

paths = sorted(glob.glob("examples/**/*.yaml", recursive=True))
for path in paths:
    load_config(path)
for path, override in [("examples/quickstart.yaml", "algorithm.policy_loss_kwargs={clip_hi: 0.3}"),
                       ("examples/gpu/grpo_qwen2.5_0.5b_gsm8k.yaml",
                        "roles.actor_train.backend_kwargs={mixed_precison: bf16}")]:
    try:
        load_config(path, [override])
    except ConfigError as error:
        print(error)
print(len(paths), "configs")
"""


def test_every_example_config_loads_without_torch():
    done = subprocess.run([sys.executable, "-c", BLOCKED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    option_error, backend_error, count = done.stdout.splitlines()
    assert "unknown option 'clip_hi' for policy loss 'ppo'; did you mean 'clip_high'?" in option_error
    assert "did you mean 'mixed_precision' for 'mixed_precison'?" in backend_error
    assert int(count.split()[0]) >= 30  # examples/ and its folders (gpu/ sets fsdp2's backend_kwargs)


REGISTRIES = [value for value in vars(registries).values() if isinstance(value, Registry)]


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda registry: registry.declared_as)
def test_what_the_source_declares_is_what_importing_registers(registry):
    declared = registry.declarations()
    assert declared, "a registry the config checks is filled from source"
    for name, declaration in declared.items():
        fn = registry.get(name)  # imports its module
        assert fn.__name__ == declaration.function and fn.__module__ == declaration.module
        assert Options.of(fn) == declaration.options, name
    assert set(registry.registered()) == set(declared)  # nothing registered that the source does not show


@pytest.mark.parametrize("name", BACKENDS.names())
def test_a_backend_s_kwargs_read_from_source_are_its_constructor_s(name):
    parameters = inspect.signature(backend_class(name)).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    assert backend_kwarg_names(name) == [p.name for p in parameters if p.kind in named and p.name != "settings"]


def test_options_from_source_match_the_signature():
    import ast

    source = "def f(a, b=1, *, c, d=2, **rest): pass\ndef g(x, /, y=1, *args, z=3): pass"
    f, g = ast.parse(source).body

    def f_(a, b=1, *, c, d=2, **rest): ...
    def g_(x, /, y=1, *args, z=3): ...

    assert Options.from_source(f) == Options.of(f_) == Options(("b", "c", "d"), ("c",), True)
    assert Options.from_source(g) == Options.of(g_) == Options(("y", "z"), (), False)


def test_a_registry_declared_in_modules_needs_the_name_its_decorators_use():
    with pytest.raises(ValueError, match="declared_as"):
        Registry("thing", declared_in=("rollflow.algorithms.kl",))


REGISTRY_MODULE = "rollflow_test_declared_things"  # holds the registry the modules below register into


@pytest.fixture
def declared(tmp_path, monkeypatch):
    """A registry declared in two modules of a temporary directory, neither imported yet."""
    import types

    things = Registry("thing", declared_as="THINGS", declared_in=("declared_a", "declared_b"))
    holder = types.ModuleType(REGISTRY_MODULE)
    holder.THINGS = things
    monkeypatch.setitem(sys.modules, REGISTRY_MODULE, holder)
    (tmp_path / "declared_a.py").write_text(
        f"from {REGISTRY_MODULE} import THINGS\n\n\n"
        "@THINGS.register('plain')\ndef plain(x, *, scale=1.0, shift):\n    return x\n\n\n"
        "THINGS.register('alias')(plain)\n")
    (tmp_path / "declared_b.py").write_text(
        "from rollflow.registry import Registry\n\nTHINGS = Registry('another')  # not the declared one\n\n\n"
        "@THINGS.register('elsewhere')\ndef elsewhere(x, **options):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("declared_a", "declared_b"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return things


def test_a_declared_name_is_known_from_source_and_imported_on_first_lookup(declared):
    assert declared.names() == ["alias", "elsewhere", "plain"] and "plain" in declared and len(declared) == 3
    assert declared.options("plain") == Options(("scale", "shift"), ("shift",), False)
    assert declared.options("elsewhere") == Options((), (), True)
    assert "declared_a" not in sys.modules and declared.registered() == {}
    plain = declared.get("plain")
    assert "declared_a" in sys.modules and declared.get("alias") is plain
    assert declared.options("plain") == Options.of(plain)  # now from the function itself
    registries.check_options(declared, "elsewhere", {"anything": 1})  # **options takes every option
    with pytest.raises(ValueError, match="missing required option 'shift' for thing 'plain'"):
        registries.check_options(declared, "plain", {"scale": 2.0})
    with pytest.raises(ValueError, match="unknown option 'scal' for thing 'plain'; did you mean 'scale'"):
        registries.check_options(declared, "plain", {"scal": 2.0, "shift": 0.0})


def test_a_declaration_its_module_does_not_register_is_an_error_not_a_silent_miss(declared):
    from rollflow.registry import UnknownNameError

    with pytest.raises(RuntimeError, match="declared_b declares it in its source but did not register it"):
        declared.get("elsewhere")
    with pytest.raises(UnknownNameError, match="Did you mean 'plain'"):
        declared.get("plian")
    with pytest.raises(UnknownNameError):
        declared.options("plian")


def test_a_name_declared_in_two_modules_is_refused(tmp_path, monkeypatch):
    for name in ("twice_a", "twice_b"):
        (tmp_path / f"{name}.py").write_text("@THINGS.register('same')\ndef same(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="thing 'same' is declared twice: in twice_a and twice_b"):
        Registry("thing", declared_as="THINGS", declared_in=("twice_a", "twice_b")).names()


def test_a_backend_without_its_own_constructor_is_read_from_the_class(tmp_path, monkeypatch):
    from rollflow.errors import ConfigError

    (tmp_path / "inherited_backend.py").write_text(
        "class Base:\n    def __init__(self, settings, knob=1):\n        pass\n\n\nclass Inherited(Base):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS._entries, "inherited", "inherited_backend:Inherited")
    assert backend_kwarg_names("inherited") == ["knob"]
    with pytest.raises(ConfigError, match="unknown training backend 'torhc'"):
        backend_kwarg_names("torhc")
    with pytest.raises(ConfigError, match="unknown training backend 'torhc'"):
        backend_class("torhc")


def test_the_algorithms_package_imports_a_module_on_first_use_of_its_name():
    import rollflow.algorithms as algorithms

    assert "whiten" in dir(algorithms) and callable(algorithms.whiten)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_function'"):
        algorithms.no_such_function  # noqa: B018
