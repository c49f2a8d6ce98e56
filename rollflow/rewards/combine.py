"""Several rewards combined into one weighted total, each part kept for logging.

How a reward's value enters the total:

* a float `v` from reward `name` with weight `w` adds `w * v`; `parts[name] = v`.
* a dict from reward `name`: if it has the key `"reward"`, that entry is the reward's value (`w * d["reward"]`
  goes into the total) and the other entries are logged only; without `"reward"`, the reward's value is
  the sum of all entries. Either way `parts[name]` is that value and each other entry `k` is logged as
  `parts[f"{name}/{k}"]`, unweighted.

`parts` always holds unweighted values, so metrics stay comparable when weights change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rollflow.rewards.registry import RewardFn

CombinedRewardFn = Callable[..., tuple[float, dict[str, float]]]


def _as_float(value: object, where: str) -> float:
    if not isinstance(value, (int, float)):  # bool is an int: True counts as 1.0
        raise TypeError(f"{where} returned {type(value).__name__}, expected a float or a dict of floats")
    result = float(value)
    if math.isnan(result):
        raise ValueError(f"{where} returned NaN")
    return result


def combine_rewards(rewards: Sequence[tuple[str, RewardFn, float]]) -> CombinedRewardFn:
    """Build one function that computes every reward and their weighted total.

    Args:
        rewards: `(name, fn, weight)` triples; names must be unique and must not contain "/".

    Returns:
        `combined(completion, **row) -> (total, parts)`: `total` is the weighted sum described in the
        module docstring, `parts` maps each reward name (and `name/key` for dict entries) to its unweighted
        value. An exception from a reward propagates, so the caller can mark the sample failed.
    """
    if not rewards:
        raise ValueError("combine_rewards needs at least one (name, fn, weight)")
    names = [name for name, _, _ in rewards]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique; repeated: {', '.join(duplicates)}")
    for name, fn, weight in rewards:
        if "/" in name:
            raise ValueError(f"reward name {name!r} must not contain '/' (used for dict entries)")
        if not callable(fn):
            raise TypeError(f"reward {name!r} is not callable")
        if not math.isfinite(float(weight)):
            raise ValueError(f"reward {name!r} has a non-finite weight {weight!r}")
    triples = [(name, fn, float(weight)) for name, fn, weight in rewards]

    def combined(completion: str, **row) -> tuple[float, dict[str, float]]:
        total = 0.0
        parts: dict[str, float] = {}
        for name, fn, weight in triples:
            value = fn(completion, **row)
            if isinstance(value, dict):
                entries = {key: _as_float(v, f"reward {name!r} entry {key!r}") for key, v in value.items()}
                score = entries.pop("reward") if "reward" in entries else sum(entries.values())
                for key, entry in entries.items():
                    parts[f"{name}/{key}"] = entry
            else:
                score = _as_float(value, f"reward {name!r}")
            parts[name] = score
            total += weight * score
        return total, parts

    return combined
