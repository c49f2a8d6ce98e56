"""The prompt-group program's scoring, without engines or Ray: rewards on the reward pool."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

from rollflow.data.prompts import EncodedPrompt
from rollflow.data.sample import Sample, SampleStatus
from rollflow.engines.base import SamplingParams
from rollflow.rewards.combine import CombinedReward
from rollflow.rewards.pool import RewardPool
from rollflow.rollout.prompt_groups import PromptGroups


class _Play:
    """What `score` uses of a `Play`: progress reports, counted."""

    def __init__(self):
        self.progressed = 0

    def progress(self) -> None:
        self.progressed += 1


def test_a_pool_reward_that_raises_fails_its_samples_and_logs_no_unread_future(caplog):
    """Every reward call raises while `score` waits on the pool: the samples fail with the reward's error and
    asyncio logs no "Future exception was never retrieved" (the wait's copies of the pool futures are read)."""
    release = threading.Event()

    def breaks_on_odd(completion, **row):
        release.wait(timeout=30)  # still running when `score` starts waiting on the pool
        if len(completion) % 2:
            raise ValueError(f"cannot score {completion!r}")
        return 1.0

    pool = RewardPool(num_threads=2, timeout_s=30)
    program = PromptGroups(CombinedReward([("breaks_on_odd", breaks_on_odd, 1.0)], pool=pool), str,
                           SamplingParams(4, n=3))
    samples = [Sample([1], [2], response_text=text) for text in ("a", "bb", "ccc")]
    play = _Play()

    async def score() -> None:
        scoring = asyncio.ensure_future(program.score(EncodedPrompt({"answer": "1"}, "1=", [1]), samples, play))
        await asyncio.sleep(0)  # `score` runs up to its first wait: every reward call is queued or running
        release.set()
        await scoring

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(score())
            gc.collect()  # a Future's unread exception is logged when the future is collected
    finally:
        pool.close()
    assert [s.status for s in samples] == [SampleStatus.FAILED, SampleStatus.FINISHED, SampleStatus.FAILED]
    assert samples[0].metadata["error"] == "ValueError: cannot score 'a'"
    assert samples[1].reward == 1.0
    assert play.progressed == 3  # one report per pool future waited on
    assert "never retrieved" not in caplog.text, caplog.text


def test_a_remote_calls_failure_leads_with_what_the_call_raised():
    """A reward worker's error reaches the driver as a Ray task error whose first line is Ray's header (the
    worker's pid and repr): the sample's error, and the step's warning that quotes its first line, name what
    the reward raised."""
    from ray.exceptions import RayTaskError

    from rollflow.data.sample import Sample, SampleStatus
    from rollflow.rollout.filters import failure_warning
    from rollflow.rollout.prompt_groups import fail

    error = RayTaskError("score_group", "Traceback (most recent call last):\n  File \"reward.py\", line 1\n"
                        "RuntimeError: reward worker is offloaded", RuntimeError("reward worker is offloaded"))
    failed, kept = Sample([1], [2], group_id=0), Sample([1], [3], group_id=0)
    fail(failed, error)
    assert failed.status == SampleStatus.FAILED
    assert failed.metadata["error"].splitlines()[0] == "RuntimeError: reward worker is offloaded"
    assert "RayTaskError" in failed.metadata["error"]  # Ray's text, with the worker's traceback, follows
    assert failure_warning([failed, kept], "step 5") == \
        "step 5: 1 of 2 samples failed; the first failed with: RuntimeError: reward worker is offloaded"
    plain = Sample([1], [2], group_id=0)
    fail(plain, ValueError("bad row"))
    assert plain.metadata["error"] == "ValueError: bad row"
