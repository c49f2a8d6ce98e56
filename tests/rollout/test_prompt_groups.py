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
