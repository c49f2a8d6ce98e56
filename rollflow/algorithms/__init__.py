"""Pure-torch RL algorithms: advantage estimators, policy losses, KL estimators, loss aggregation, and the
agentic (multi-turn) advantages over episodes and steps.

Implementations are chosen by name from the registries; importing this package registers them all.
Shapes: B samples, T response tokens (right-padded), `mask` [B, T] float 1.0 on trained tokens,
`group_ids` [B] long; the agentic estimators take flat [S] rows (episodes or steps).
See docs/algorithms.md for the formulas and defaults.
"""

from rollflow.algorithms.advantages import AdvantageInputs
from rollflow.algorithms.agentic import (
    AgenticAdvantageInputs,
    discounted_step_returns,
    episode_group_advantages,
    gigpo_advantages,
    step_reinforce_advantages,
)
from rollflow.algorithms.aggregation import LossNormalizer, aggregate_loss, loss_normalizer
from rollflow.algorithms.corrections import masked_is, train_infer_correction, truncated_is_weights
from rollflow.algorithms.distillation import DIVERGENCES, distill_token_loss, restrict_to_topk
from rollflow.algorithms.kl import AdaptiveKLController, FixedKLController, kl_penalty
from rollflow.algorithms.policy_losses import PolicyLossInputs, entropy_from_logits
from rollflow.algorithms.preference import (
    PREFERENCE_LOSSES,
    pair_weights,
    preference_metrics,
    sequence_logprob_sums,
)
from rollflow.algorithms.registries import (
    ADVANTAGE_ESTIMATORS,
    AGENTIC_ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    check_hyperparams,
)
from rollflow.algorithms.reward_shaping import (
    RunningMoments,
    clip_advantages,
    clip_rewards,
    difficulty_mask,
    normalize_rewards,
    normalize_rewards_by_domain,
    overlong_filter_mask,
    overlong_reward_penalty,
    whiten,
)
from rollflow.algorithms.supervised import token_nll
from rollflow.algorithms.value_loss import clipped_value_loss

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
