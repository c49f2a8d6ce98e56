"""Closing the math-verify helpers while they still start (a run that stops right after `warm_up_rewards`)
logs nothing: a helper cancelled before it began starting must not reach a done-callback that asks the
cancelled future for its exception (concurrent.futures logs "exception calling callback" with a traceback)."""

from __future__ import annotations

import logging
import threading
import time

from rollflow.rewards import math_verifier
from rollflow.rewards.math_verifier import MathVerifier


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s"
        time.sleep(0.01)


def test_closing_helpers_that_are_still_starting_logs_no_callback_error(caplog, monkeypatch):
    began, release = threading.Event(), threading.Event()
    real_helper = math_verifier._Helper

    def held_helper():  # the first helper is starting, and stays so until the verifier is closed
        began.set()
        assert release.wait(60)
        return real_helper()

    monkeypatch.setattr(math_verifier, "_Helper", held_helper)
    verifier = MathVerifier(max_helpers=2)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        verifier.start_helpers()
        starting = list(verifier._idle.queue)
        assert began.wait(60)
        verifier.close()  # one spawner thread starts them one by one: the second has not begun
        release.set()
        _wait_until(lambda: all(slot.done() for slot in starting))
        started = [slot.result() for slot in starting if not slot.cancelled()]
        # the started helper's callbacks (`_track`, then `_kill_started`) have run: killed, and forgotten
        _wait_until(lambda: all(h.process.poll() is not None and h not in verifier._all for h in started))
    assert any(slot.cancelled() for slot in starting) and started  # the case at hand
    assert [record.getMessage() for record in caplog.records] == []  # was: "exception calling callback for <Future>"
