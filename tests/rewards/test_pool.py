"""The reward pool: a hung or raising reward call costs its sample, never the step, and never a thread."""

from __future__ import annotations

import threading
import time

import pytest

from rollflow.rewards.combine import combine_rewards
from rollflow.rewards.pool import RewardPool, RewardTimeoutError


def test_a_hung_call_times_out_and_the_pool_keeps_serving():
    release = threading.Event()
    pool = RewardPool(num_threads=1, timeout_s=0.3)
    try:
        started = time.monotonic()
        hung = pool.submit("stuck", release.wait)  # blocks its thread until released
        after = pool.submit("fine", lambda x: x + 1, (41,))
        with pytest.raises(RewardTimeoutError, match=r"reward 'stuck' timed out after 0.3 s"):
            hung.result(timeout=5)
        assert 0.3 <= time.monotonic() - started < 10  # its 0.3 s limit (the upper bound: a hang guard)
        assert after.result(timeout=5) == 42  # the only thread hung; a replacement served the next call
        assert pool.timeouts == 1
    finally:
        release.set()
        pool.close()


def test_exceptions_and_keyword_columns_reach_the_future():
    pool = RewardPool(num_threads=2, timeout_s=5)
    try:
        def reward(completion, label, fn):  # columns named like the pool's own parameters
            return f"{completion}:{label}:{fn}"

        assert pool.submit("r", reward, ("c",), {"label": 1, "fn": 2}).result(timeout=5) == "c:1:2"
        with pytest.raises(ZeroDivisionError):
            pool.submit("r", lambda: 1 / 0).result(timeout=5)
    finally:
        pool.close()


@pytest.mark.parametrize("returned, message", [
    (float("nan"), "returned nan, expected a finite number"),
    (float("inf"), "returned inf, expected a finite number"),
    ("1.0", "returned str, expected a float"),
    (None, "returned NoneType, expected a float"),
])
def test_bad_reward_values_fail_their_sample(returned, message):
    combined = combine_rewards([("bad", lambda c, **row: returned, 1.0)], RewardPool(1, 5.0))
    (outcome,) = combined.score_group(["x"], [{}])
    assert isinstance(outcome, Exception) and message in str(outcome)
    combined.close()


def test_a_timed_out_reward_fails_only_its_sample():
    def slow_on_b(completion, **row):
        if completion == "b":
            time.sleep(30)
        return 1.0

    combined = combine_rewards([("slow", slow_on_b, 1.0)], RewardPool(2, 0.2))
    a, b = combined.score_group(["a", "b"], [{}, {}])
    assert a == (1.0, {"slow": 1.0})
    assert isinstance(b, RewardTimeoutError)
    combined.close()


def test_closing_twice_is_harmless():
    """A multi-domain run's reward combinations share one pool, and each closes it."""
    pool = RewardPool(num_threads=2, timeout_s=5.0)
    assert pool.submit("double", lambda x: 2 * x, (3,)).result(timeout=5) == 6
    pool.close()
    pool.close()
