"""Closing the math-verify helpers while they still start (a run that stops right after `warm_up_rewards`)
logs nothing: a helper cancelled before it began starting must not reach a done-callback that asks the
cancelled future for its exception (concurrent.futures logs "exception calling callback" with a traceback)."""

from __future__ import annotations

import logging
import time

from rollflow.rewards.math_verifier import MathVerifier


def test_closing_helpers_that_are_still_starting_logs_no_callback_error(caplog):
    verifier = MathVerifier(max_helpers=2)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        verifier.start_helpers()
        starting = list(verifier._idle.queue)
        verifier.close()  # one spawner thread starts them one by one (~1 s each): the second has not begun
        deadline = time.monotonic() + 60
        while not all(slot.done() for slot in starting) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # the started helper's callback (`_kill_started`) has run by then
    assert any(slot.cancelled() for slot in starting)  # the case at hand
    assert [record.getMessage() for record in caplog.records] == []  # was: "exception calling callback for <Future>"
    started = [slot.result() for slot in starting if not slot.cancelled()]
    assert all(helper.process.poll() is not None for helper in started)  # killed once up
