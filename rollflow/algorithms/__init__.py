"""Pure-torch RL algorithms: advantage estimators, policy losses, KL estimators, loss aggregation, and the
agentic (multi-turn) advantages over episodes and steps.

Implementations are chosen by name from the registries (`registries`, which imports no torch). The package
imports each module on first use of a name from it (`rollflow.algorithms.whiten` imports `reward_shaping`), and
a registry imports the module of a name when the name is looked up: `import rollflow.algorithms.registries`, as
the config does, imports no torch.

Shapes: B samples, T response tokens (right-padded), `mask` [B, T] float 1.0 on trained tokens,
`group_ids` [B] long; the agentic estimators take flat [S] rows (episodes or steps).
See docs/algorithms.md for the formulas and defaults.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it, imported on first use
_HOMES = {
    "AdvantageInputs": "advantages",
    "AgenticAdvantageInputs": "agentic",
    "discounted_step_returns": "agentic",
    "episode_group_advantages": "agentic",
    "gigpo_advantages": "agentic",
    "step_reinforce_advantages": "agentic",
    "LossNormalizer": "aggregation",
    "aggregate_loss": "aggregation",
    "loss_normalizer": "aggregation",
    "masked_is": "corrections",
    "train_infer_correction": "corrections",
    "truncated_is_weights": "corrections",
    "distill_token_loss": "distillation",
    "restrict_to_topk": "distillation",
    "AdaptiveKLController": "kl",
    "FixedKLController": "kl",
    "kl_penalty": "kl",
    "PolicyLossInputs": "policy_losses",
    "entropy_from_logits": "policy_losses",
    "pair_weights": "preference",
    "preference_metrics": "preference",
    "sequence_logprob_sums": "preference",
    "ADVANTAGE_ESTIMATORS": "registries",
    "AGENTIC_ADVANTAGES": "registries",
    "KL_ESTIMATORS": "registries",
    "LOSS_AGGREGATIONS": "registries",
    "POLICY_LOSSES": "registries",
    "check_hyperparams": "registries",
    "check_options": "registries",
    "DIVERGENCES": "registries",
    "PREFERENCE_LOSSES": "registries",
    "TURN_LEVEL_LOSSES": "registries",
    "RunningMoments": "reward_shaping",
    "clip_advantages": "reward_shaping",
    "clip_rewards": "reward_shaping",
    "difficulty_mask": "reward_shaping",
    "normalize_rewards": "reward_shaping",
    "normalize_rewards_by_domain": "reward_shaping",
    "overlong_filter_mask": "reward_shaping",
    "overlong_reward_penalty": "reward_shaping",
    "whiten": "reward_shaping",
    "token_nll": "supervised",
    "clipped_value_loss": "value_loss",
}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGENTIC_ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AgenticAdvantageInputs",
    "FixedKLController",
    "LossNormalizer",
    "PolicyLossInputs",
    "RunningMoments",
    "aggregate_loss",
    "check_hyperparams",
    "check_options",
    "TURN_LEVEL_LOSSES",
    "clip_advantages",
    "clip_rewards",
    "clipped_value_loss",
    "difficulty_mask",
    "discounted_step_returns",
    "episode_group_advantages",
    "gigpo_advantages",
    "entropy_from_logits",
    "kl_penalty",
    "loss_normalizer",
    "masked_is",
    "normalize_rewards",
    "normalize_rewards_by_domain",
    "overlong_filter_mask",
    "overlong_reward_penalty",
    "token_nll",
    "train_infer_correction",
    "truncated_is_weights",
    "whiten",
    "DIVERGENCES",
    "PREFERENCE_LOSSES",
    "distill_token_loss",
    "pair_weights",
    "preference_metrics",
    "restrict_to_topk",
    "sequence_logprob_sums",
    "step_reinforce_advantages",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
