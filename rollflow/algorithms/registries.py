"""The algorithm registries and the check that a config's options fit the chosen function.

Each algorithm module registers its functions here by name; `rollflow.algorithms` re-exports the registries.
Call signatures of the registered functions:

* `ADVANTAGE_ESTIMATORS[name](inputs: AdvantageInputs, **options) -> (advantages [B, T], returns [B, T], metrics)`
* `POLICY_LOSSES[name](inputs: PolicyLossInputs, **options) -> (per_token_loss [B, T], metrics)`
* `KL_ESTIMATORS[name](logprobs [B, T], ref_logprobs [B, T]) -> kl [B, T]`
* `LOSS_AGGREGATIONS[name](per_token_loss [B, T], mask [B, T], normalizer: LossNormalizer) -> scalar`
* `AGENTIC_ADVANTAGES[name](inputs: AgenticAdvantageInputs, **options) -> (advantages [S], metrics)`, over
  flat per-episode or per-step rows (`rollflow.algorithms.agentic`)

Options are keyword-only parameters with defaults, so `check_hyperparams` can validate a config's keys
against the function before the first step runs.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from rollflow.registry import Registry

ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator")
LOSS_AGGREGATIONS: Registry[Callable[..., Any]] = Registry("loss aggregation")
AGENTIC_ADVANTAGES: Registry[Callable[..., Any]] = Registry("agentic advantage estimator")

_ALL_REGISTRIES = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, LOSS_AGGREGATIONS, AGENTIC_ADVANTAGES)


def _describe(fn: Callable[..., Any]) -> str:
    """'policy loss 'ppo'' when `fn` is registered somewhere, else 'function 'my_fn''."""
    for registry in _ALL_REGISTRIES:
        for name in registry.names():
            if registry.get(name) is fn:
                return f"{registry.kind} {name!r}"
    return f"function {getattr(fn, '__name__', repr(fn))!r}"


def option_names(fn: Callable[..., Any]) -> list[str]:
    """The options (hyperparameters) a registered function accepts.

    Args:
        fn: a registered algorithm function.

    Returns:
        Sorted names of its keyword-only parameters and of its positional parameters that have defaults.
    """
    names = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            names.append(param.name)
        elif param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and param.default is not param.empty:
            names.append(param.name)
    return sorted(names)


def check_hyperparams(fn: Callable[..., Any], hyperparams: dict[str, Any]) -> None:
    """Fail early when a config passes options that `fn` does not take, or omits a required one.

    Args:
        fn: a registered algorithm function (e.g. `POLICY_LOSSES.get("ppo")`).
        hyperparams: the options the config will pass as keyword arguments.

    Raises:
        ValueError: naming the unknown option, the nearest valid one, and all valid ones, e.g.
            "unknown option 'clip_hi' for policy loss 'ppo'; did you mean 'clip_high'? valid: clip_high, ...".
    """
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    valid = option_names(fn)
    for key in hyperparams:
        if key in valid:
            continue
        near = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        listed = ", ".join(valid) if valid else "(none)"
        raise ValueError(f"unknown option {key!r} for {_describe(fn)}; {hint}valid: {listed}")
    for param in params:
        required = param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is param.empty
        if required and param.name not in hyperparams:
            raise ValueError(f"missing required option {param.name!r} for {_describe(fn)}")
