"""Several rewards combined into one weighted total, each part kept for logging.

How a reward's value enters the total:

* a float `v` from reward `name` with weight `w` adds `w * v`; `parts[name] = v`.
* a dict from reward `name`: if it has the key `"reward"`, that entry is the reward's value (`w * d["reward"]`
  goes into the total) and the other entries are logged only; without `"reward"`, the reward's value is
  the sum of all entries. Either way `parts[name]` is that value and each other entry `k` is logged as
  `parts[f"{name}/{k}"]`, unweighted.

`parts` always holds unweighted values, so metrics stay comparable when weights change.

Two kinds of reward mix freely. A plain function `fn(completion, **row)` runs where it is called (on the
driver), one sample at a time. A *group reward* (`GroupReward`: an LLM judge or a reward model behind reward
workers) scores a whole group in one call and answers later: `submit_group` sends the group to every group
reward first, then runs the plain functions while the workers score, and returns a `PendingGroup` whose
futures the caller waits on (the rollout core keeps playing other groups meanwhile); its `finish`
turns the results into `(total, parts)` per sample.

A multi-domain run (`data.domains`) may give each domain its own combination: `DomainRewards` sends each
group to the combination of its rows' `domain`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rollflow.rewards.pool import RewardPool
from rollflow.rewards.registry import RewardLoadError, Row, ScoreError, reward_key

Outcome = tuple[float, dict[str, float]] | Exception  # one sample's (total, parts), or why it failed


@runtime_checkable
class GroupReward(Protocol):
    """A reward scored off the driver, a group per call (`rollflow.workers.reward.RemoteReward`).

    `submit` returns a future (a `ray.ObjectRef`) of a list with one value per completion: a float, a dict
    of floats, or a `ScoreError`. `wait` blocks for it; `close` releases the workers.
    """

    def submit(self, completions: list[str], rows: list[Row]) -> Any: ...

    def wait(self, future: Any) -> list[Any]: ...

    def close(self) -> None: ...


class RewardScoreError(RuntimeError):
    """A group reward could not score a sample (`ScoreError`); the sample is marked failed."""


def _as_float(value: object, where: str) -> float:
    if not isinstance(value, (int, float)):  # bool is an int: True counts as 1.0
        raise TypeError(f"{where} returned {type(value).__name__}, expected a float or a dict of floats")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{where} returned {result}, expected a finite number")
    return result


def _entries(name: str, value: object) -> tuple[float, dict[str, float]]:
    """One reward's value and its logged-only entries (keys already prefixed with `name/`)."""
    if isinstance(value, ScoreError):
        raise RewardScoreError(f"reward {name!r}: {value.message}")
    if isinstance(value, BaseException):  # a whole group failed (its worker raised or died)
        raise value
    if not isinstance(value, dict):
        return _as_float(value, f"reward {name!r}"), {}
    entries = {key: _as_float(v, f"reward {name!r} entry {key!r}") for key, v in value.items()}
    score = entries.pop("reward") if "reward" in entries else sum(entries.values())
    return score, {f"{name}/{key}": entry for key, entry in entries.items()}


@dataclass
class PendingGroup:
    """A group whose plain rewards are computed and whose group rewards are still being scored.

    Attributes:
        futures: one future per group reward of the combination, in order (`ray.ObjectRef`s for reward
            workers). Empty when the combination has only plain functions: `finish([])` then completes.
    """

    futures: list[Any]
    _combined: CombinedReward
    _plain: list[list[Any]]  # [sample][plain reward] value, the exception it raised, or a pool Future
    _size: int

    @property
    def plain_pending(self) -> bool:
        """Plain rewards still running on the reward pool (`CombinedReward(pool=...)`)."""
        return any(self._running())

    def plain_futures(self) -> list[Future]:
        """The pool futures of the plain rewards still running (to be told when they end)."""
        return list(self._running())

    def _running(self) -> Iterator[Future]:
        return (v for values in self._plain for v in values if isinstance(v, Future) and not v.done())

    def finish(self, group_results: list[Any]) -> list[Outcome]:
        """Combine everything into one outcome per sample.

        Args:
            group_results: for each future, its list of values (one per sample), or the exception that
                getting it raised (the whole group then fails for that reward).

        Returns:
            Per sample, `(total, parts)`, or the first exception of any of its rewards (mark it failed).
        """
        if len(group_results) != len(self.futures):
            raise ValueError(f"expected {len(self.futures)} group results, got {len(group_results)}")
        for values in group_results:
            if not isinstance(values, BaseException) and len(values) != self._size:
                raise ValueError(f"a group reward returned {len(values)} values for {self._size} samples")
        outcomes: list[Outcome] = []
        for i in range(self._size):
            plain, grouped = iter([_settled(v) for v in self._plain[i]]), iter(group_results)
            values = []
            for kind in self._combined.kinds:
                if kind == "plain":
                    values.append(next(plain))
                else:  # a whole-group failure is one exception shared by every sample of the group
                    result = next(grouped)
                    values.append(result if isinstance(result, BaseException) else result[i])
            outcomes.append(self._combined.total(values))
        return outcomes

    def wait(self) -> list[Outcome]:
        """Block for the group rewards (through each reward's `wait`) and finish."""
        results = []
        for reward, future in zip(self._combined.group_rewards, self.futures):
            try:
                results.append(reward.wait(future))
            except Exception as error:  # a failed group fails its samples, the caller decides what that means
                results.append(error)
        return self.finish(results)


class CombinedReward:
    """The weighted combination built by `combine_rewards`. See the module docstring.

    Call it as `combined(completion, **row) -> (total, parts)` for one sample (raising when a reward
    raises), or use `submit_group` / `score_group` for a group.
    """

    def __init__(self, triples: list[tuple[str, Any, float]], pool: RewardPool | None = None):
        self.triples = triples
        self.pool = pool
        self.kinds = ["group" if isinstance(fn, GroupReward) else "plain" for _, fn, _ in triples]
        self.group_rewards = [fn for (_, fn, _), kind in zip(triples, self.kinds) if kind == "group"]

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.triples]

    def total(self, values: list[Any]) -> Outcome:
        """`(total, parts)` from one value per reward (in order); the first exception among them instead."""
        total, parts = 0.0, {}
        try:
            for (name, _, weight), value in zip(self.triples, values):
                score, logged = _entries(name, value)
                parts.update(logged)
                parts[name] = score
                total += weight * score
        except Exception as error:
            return error
        return total, parts

    def submit_group(self, completions: list[str], rows: list[Row]) -> PendingGroup:
        """Send the group to every group reward, then compute the plain rewards here.

        Args:
            completions: the decoded completions.
            rows: each completion's dataset row (the same row for a prompt's group).

        Returns:
            A `PendingGroup`: wait on its `futures`, then call `finish`. Exceptions of plain rewards are
            kept per sample; an exception from submitting (a reward worker that cannot start) propagates.
        """
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        futures = [reward.submit(list(completions), list(rows)) for reward in self.group_rewards]
        plain_fns = [(name, fn) for (name, fn, _), kind in zip(self.triples, self.kinds) if kind == "plain"]
        if self.pool is None:
            plain = [[_call(fn, completion, row) for _, fn in plain_fns]
                     for completion, row in zip(completions, rows)]
        else:
            plain = [[self.pool.submit(name, fn, (completion,), row) for name, fn in plain_fns]
                     for completion, row in zip(completions, rows)]
        return PendingGroup(futures, self, plain, len(completions))

    def score_group(self, completions: list[str], rows: list[Row]) -> list[Outcome]:
        """`submit_group` and wait: one `(total, parts)` or exception per sample."""
        return self.submit_group(completions, rows).wait()

    def __call__(self, completion: str, **row) -> tuple[float, dict[str, float]]:
        outcome = self.score_group([completion], [row])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def start(self, wait: bool = True) -> None:
        """Start every group reward's workers now (they otherwise start on first use).

        Args:
            wait: block until their models are loaded, which surfaces a bad model path before the first
                step. False: they load in the background (alongside the other roles' workers) and the
                first group waits for them.
        """
        for reward in self.group_rewards:
            start = getattr(reward, "start", None)
            if start is not None:
                start(wait=wait)

    def close(self) -> None:
        """Release the group rewards' workers and the pool's threads."""
        for reward in self.group_rewards:
            reward.close()
        if self.pool is not None:
            self.pool.close()


class DomainRewards:
    """One `CombinedReward` per domain: a group is scored by the combination of its domain, the column
    `domain` of its rows (`"default"` when absent), or by `default` when the domain has none of its own.

    It offers what callers use of a `CombinedReward`: `submit_group`, `score_group`, a call per sample,
    `names`, `start` and `close`.

    Args:
        by_domain: domain name -> its combination.
        default: the combination of every other domain.
    """

    def __init__(self, by_domain: dict[str, CombinedReward], default: CombinedReward):
        self.by_domain = by_domain
        self.default = default

    @property
    def combinations(self) -> list[CombinedReward]:
        return [self.default, *self.by_domain.values()]

    @property
    def names(self) -> list[str]:
        """Every reward's name, once, in the order they first appear (the default's first)."""
        return list(dict.fromkeys(name for combined in self.combinations for name in combined.names))

    def of(self, domain: str) -> CombinedReward:
        """The combination that scores `domain`'s prompts."""
        return self.by_domain.get(domain, self.default)

    def submit_group(self, completions: list[str], rows: list[Row]) -> PendingGroup:
        """`CombinedReward.submit_group` of the group's domain (a group is one prompt, so one domain).

        Raises:
            ValueError: rows of more than one domain.
        """
        domains = {str(row.get("domain", "default")) for row in rows}
        if len(domains) > 1:
            raise ValueError(f"a group's rows are of one domain, got {', '.join(sorted(domains))}")
        domain = domains.pop() if domains else "default"
        return self.of(domain).submit_group(completions, rows)

    def score_group(self, completions: list[str], rows: list[Row]) -> list[Outcome]:
        """`submit_group` and wait: one `(total, parts)` or exception per sample."""
        return self.submit_group(completions, rows).wait()

    def __call__(self, completion: str, **row) -> tuple[float, dict[str, float]]:
        return self.of(str(row.get("domain", "default")))(completion, **row)

    def start(self, wait: bool = True) -> None:
        """`CombinedReward.start` of every combination."""
        for combined in self.combinations:
            combined.start(wait=wait)

    def close(self) -> None:
        """`CombinedReward.close` of every combination (they may share a pool, which closes once)."""
        for combined in self.combinations:
            combined.close()


def _settled(value: Any) -> Any:
    """A plain reward's value: a pool future's result (or the exception it raised), else the value."""
    if not isinstance(value, Future):
        return value
    try:
        return value.result()
    except Exception as error:  # a reward that raised or timed out fails its sample
        return error


def _call(fn, completion: str, row: Row) -> Any:
    try:
        return fn(completion, **row)
    except Exception as error:  # kept per sample: a broken reward fails its sample, never the group
        return error


def combine_rewards(rewards: Sequence[tuple[str, Any, float]], pool: RewardPool | None = None) -> CombinedReward:
    """Build one function that computes every reward and their weighted total.

    Args:
        rewards: `(name, fn, weight)` triples; `fn` is a plain reward function or a `GroupReward`. A name
            given as a file path (`rewards/score.py:score`) is logged by its file name (`score.py:score`,
            `reward_key`); names must then be unique and must not contain "/".
        pool: run plain functions on this `RewardPool` (time limit per call, off the caller's thread);
            None: call them inline.

    Returns:
        A `CombinedReward`: `combined(completion, **row) -> (total, parts)`, where `total` is the weighted
        sum described in the module docstring and `parts` maps each reward name (and `name/key` for dict
        entries) to its unweighted value. An exception from a reward propagates, so the caller can mark the
        sample failed. `combined.submit_group(completions, rows)` scores a group without blocking on group
        rewards.
    """
    if not rewards:
        raise RewardLoadError("combine_rewards needs at least one (name, fn, weight)")
    rewards = [(reward_key(name), fn, weight) for name, fn, weight in rewards]
    names = [name for name, _, _ in rewards]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RewardLoadError(f"reward names must be unique (a file path's reward is named by its file name "
                              f"and function); repeated: {', '.join(duplicates)}")
    for name, fn, weight in rewards:
        if "/" in name:
            raise RewardLoadError(f"reward name {name!r} must not contain '/' (used for dict entries)")
        if not callable(fn) and not isinstance(fn, GroupReward):
            hint = (" (a model reward: build it with rollflow.workers.reward.build_reward_fn, which "
                    "starts its reward workers)" if hasattr(fn, "scorer") else "")
            raise TypeError(f"reward {name!r} is not callable{hint}")
        if not math.isfinite(float(weight)):
            raise RewardLoadError(f"reward {name!r} has a non-finite weight {weight!r}")
    return CombinedReward([(name, fn, float(weight)) for name, fn, weight in rewards], pool)
