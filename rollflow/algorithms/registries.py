"""The algorithm registries and the check that a config's options fit the chosen function.

Each algorithm module registers its functions here by name; `rollflow.algorithms` re-exports the registries.
This module imports no torch: each registry knows its names and their options from the source of the modules
that register into it (`declared_in`), and imports such a module only when one of its names is looked up
(`rollflow.registry.Registry`). So a config is loaded and checked without torch.

Call signatures of the registered functions:

* `ADVANTAGE_ESTIMATORS[name](inputs: AdvantageInputs, **options) -> (advantages [B, T], returns [B, T], metrics)`
* `POLICY_LOSSES[name](inputs: PolicyLossInputs, **options) -> (per_token_loss [B, T], metrics)`
* `KL_ESTIMATORS[name](logprobs [B, T], ref_logprobs [B, T]) -> kl [B, T]`
* `LOSS_AGGREGATIONS[name](per_token_loss [B, T], mask [B, T], normalizer: LossNormalizer) -> scalar`
* `AGENTIC_ADVANTAGES[name](inputs: AgenticAdvantageInputs, **options) -> (advantages [S], metrics)`, over
  flat per-episode or per-step rows (`rollflow.algorithms.agentic`)
* `DIVERGENCES[name](student_logq [B, T, K], teacher_logp [B, T, K], **options) -> [B, T]`
  (`rollflow.algorithms.distillation`)
* `PREFERENCE_LOSSES[name](...)`: the DPO family (`rollflow.algorithms.preference`)

Options are keyword-only parameters with defaults, so `check_options` can validate a config's keys against
the function before the first step runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from rollflow.registry import Options, Registry

_PACKAGE = "rollflow.algorithms"
ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "advantage estimator", declared_as="ADVANTAGE_ESTIMATORS", declared_in=(f"{_PACKAGE}.advantages",))
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry(
    "policy loss", declared_as="POLICY_LOSSES", declared_in=(f"{_PACKAGE}.policy_losses", f"{_PACKAGE}.agentic"))
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "KL estimator", declared_as="KL_ESTIMATORS", declared_in=(f"{_PACKAGE}.kl",))
LOSS_AGGREGATIONS: Registry[Callable[..., Any]] = Registry(
    "loss aggregation", declared_as="LOSS_AGGREGATIONS", declared_in=(f"{_PACKAGE}.aggregation",))
AGENTIC_ADVANTAGES: Registry[Callable[..., Any]] = Registry(
    "agentic advantage estimator", declared_as="AGENTIC_ADVANTAGES", declared_in=(f"{_PACKAGE}.agentic",))
DIVERGENCES: Registry[Callable[..., Any]] = Registry(
    "distillation divergence", declared_as="DIVERGENCES", declared_in=(f"{_PACKAGE}.distillation",))
PREFERENCE_LOSSES: Registry[Callable[..., Any]] = Registry(
    "preference loss", declared_as="PREFERENCE_LOSSES", declared_in=(f"{_PACKAGE}.preference",))

_ALL_REGISTRIES = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, LOSS_AGGREGATIONS, AGENTIC_ADVANTAGES,
                   DIVERGENCES, PREFERENCE_LOSSES)

# Policy losses that need turn boundaries (`segment_ids`), which only multi-turn rollouts have.
TURN_LEVEL_LOSSES = ("ipa_chunk",)


def _describe(fn: Callable[..., Any]) -> str:
    """'policy loss 'ppo'' when `fn` is registered somewhere, else 'function 'my_fn''."""
    where = (getattr(fn, "__module__", None), getattr(fn, "__name__", None))
    for registry in _ALL_REGISTRIES:
        for name, declared in registry.declarations().items():
            if (declared.module, declared.function) == where:
                return f"{registry.kind} {name!r}"
        for name, registered in registry.registered().items():  # a user's own, registered at run time
            if registered is fn:
                return f"{registry.kind} {name!r}"
    return f"function {getattr(fn, '__name__', repr(fn))!r}"


def option_names(fn: Callable[..., Any]) -> list[str]:
    """The options (hyperparameters) a registered function accepts.

    Args:
        fn: a registered algorithm function.

    Returns:
        Sorted names of its keyword-only parameters and of its positional parameters that have defaults.
    """
    return list(Options.of(fn).names)


def check_hyperparams(fn: Callable[..., Any], hyperparams: dict[str, Any]) -> None:
    """Fail early when a config passes options that `fn` does not take, or omits a required one.

    Args:
        fn: a registered algorithm function (e.g. `POLICY_LOSSES.get("ppo")`).
        hyperparams: the options the config will pass as keyword arguments.

    Raises:
        ValueError: naming the unknown option, the nearest valid one, and all valid ones, e.g.
            "unknown option 'clip_hi' for policy loss 'ppo'; did you mean 'clip_high'? valid: clip_high, ...".
    """
    _check(Options.of(fn), _describe(fn), hyperparams)


def check_options(registry: Registry[Callable[..., Any]], name: str, hyperparams: dict[str, Any]) -> None:
    """`check_hyperparams` for the function `registry` holds under `name`, without importing it (its options
    as its module's source declares them, until it is imported)."""
    _check(registry.options(name), f"{registry.kind} {name!r}", hyperparams)


def _check(options: Options, described: str, hyperparams: dict[str, Any]) -> None:
    if options.any:
        return
    valid = options.names
    for key in hyperparams:
        if key in valid:
            continue
        near = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        listed = ", ".join(valid) if valid else "(none)"
        raise ValueError(f"unknown option {key!r} for {described}; {hint}valid: {listed}")
    for name in options.required:
        if name not in hyperparams:
            raise ValueError(f"missing required option {name!r} for {described}")
