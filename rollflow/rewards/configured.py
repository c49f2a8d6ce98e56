"""The rewards a run's config names, read from its `reward` section: where each list is configured, and the
model rewards among them (the ones that need reward workers)."""

from __future__ import annotations

from rollflow.rewards.registry import ModelReward, RewardLoadError, resolve_reward


def configured_rewards(reward_config) -> dict[str, list]:
    """Where each list of reward functions is configured -> that list: `reward.functions` and every domain's
    own list (`reward.domains.<name>`)."""
    return {"reward.functions": reward_config.functions,
            **{f"reward.domains.{name}": functions for name, functions in (reward_config.domains or {}).items()}}


def model_rewards(reward_config) -> dict[str, ModelReward]:
    """The configured rewards that need reward workers, by name, their options bound and checked: those of
    `reward.functions` and of every domain's own list (`reward.domains`).

    Args:
        reward_config: the `reward` config section.

    Raises:
        RewardLoadError: a reward that does not resolve, or a model reward configured with different kwargs
            in two places (its workers hold one scorer per name) (one line).
    """
    found: dict[str, tuple[str, dict, ModelReward]] = {}  # name -> (where, kwargs, reward)
    for where, functions in configured_rewards(reward_config).items():
        for function in functions:
            reward = resolve_reward(function.name, function.kwargs)
            if not isinstance(reward, ModelReward):
                continue
            if function.name in found and found[function.name][1] != function.kwargs:
                raise RewardLoadError(
                    f"model reward {function.name!r} has different kwargs in {found[function.name][0]} and "
                    f"{where}; its reward workers hold one scorer per name, so give it the same kwargs")
            found.setdefault(function.name, (where, function.kwargs, reward))
    return {name: reward for name, (_, _, reward) in found.items()}
