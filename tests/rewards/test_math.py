"""Math rewards: tricky answer forms, the fast path, time limits from threads, format and length rules."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rollflow.rewards import MissingColumnError, boxed_format, exact_match, length_penalty, math_answer
from rollflow.rewards.math import fast_math_verdict, last_boxed
from rollflow.rewards.math_verifier import KILL_GRACE_S, MathVerifier

CASES = [
    # (completion, answer, expected)
    ("The answer is \\boxed{\\frac{2}{4}}.", "1/2", 1.0),  # equivalent fractions
    ("So we get \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # decimal vs LaTeX fraction
    ("Thus x = \\boxed{\\dfrac{1}{2}}", "0.5", 1.0),  # \dfrac
    ("\\boxed{72}", "72", 1.0),
    ("She sold 48 + 24 = 72 clips in total.", "72", 1.0),  # plain number, no box
    ("72", "72.0", 1.0),  # bare answer, integer vs decimal
    ("The answer is \\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}", 1.0),  # LaTeX expression vs LaTeX
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # symbolic equality
    ("The length is \\boxed{12 \\text{ cm}}", "12", 1.0),  # units in the prediction
    ("\\boxed{1,000}", "1000", 1.0),  # thousands separator
    ("$\\boxed{\\pi/2}$", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{71.9999}", "72", 0.0),  # wrong but close
    ("\\boxed{0.33}", "1/3", 0.0),  # wrong but close
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("", "5", 0.0),  # empty completion
    ("I don't know.", "5", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), CASES)
def test_math_answer_forms(completion, answer, expected):
    assert math_answer(completion, answer=answer, prompt="q") == expected


def test_numeric_answer_column_and_missing_column():
    assert math_answer("\\boxed{3}", answer=3) == 1.0
    with pytest.raises(MissingColumnError, match="'math_answer' needs the dataset column 'answer'.*prompt"):
        math_answer("\\boxed{3}", prompt="q")
    with pytest.raises(MissingColumnError):
        exact_match("3", prompt="q")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("\\boxed{72}", "72", 1.0),  # string equality
        ("\\boxed{ 1/2 }", "0.5", 1.0),  # exact fractions
        ("\\boxed{\\frac{6}{8}}", "3/4", 1.0),
        ("  -3  ", "-3.00", 1.0),  # bare answer
        ("\\boxed{71}", "72", 0.0),  # clearly different numbers
        ("\\boxed{0.33333}", "1/3", None),  # near miss: math-verify decides (it rounds)
        ("\\boxed{\\sqrt{2}}", "1.414", None),  # not a plain number
        ("a long explanation that is not a bare answer at all, 72", "72", None),
    ],
)
def test_fast_path(completion, answer, expected):
    assert fast_math_verdict(completion, answer) == expected


def test_fast_path_costs_microseconds():
    start = time.perf_counter()
    for _ in range(1000):
        assert math_answer("Adding up, we get \\boxed{42}.", answer="42") == 1.0
    per_call = (time.perf_counter() - start) / 1000
    assert per_call < 200e-6, per_call  # ~5 us here; generous for a loaded CI machine


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unterminated
    assert last_boxed("no box") is None


def test_pathological_expression_times_out_from_a_worker_thread():
    """Signal-based limits do not work off the main thread; ours must."""
    results = {}

    def worker():
        start = time.monotonic()
        results["reward"] = math_answer("\\boxed{9^{9^{9^{9}}}}", answer="5", timeout_s=1.0)
        results["elapsed"] = time.monotonic() - start

    math_answer("\\boxed{\\sqrt{4}}", answer="2")  # start the helper outside the timed part
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert results["reward"] == 0.0
    assert results["elapsed"] < 1.0 + KILL_GRACE_S + 10.0  # its limit (a hang guard: load adds some)
    # The helper is still usable (or was replaced) afterwards.
    assert math_answer("\\boxed{\\sqrt{4}}", answer="2") == 1.0


def test_unresponsive_helper_is_killed_and_replaced():
    """The backstop: a helper that does not answer (here: stopped) is killed at timeout + grace."""
    verifier = MathVerifier(max_helpers=1)
    try:
        assert verifier.verify("2", "\\boxed{\\sqrt{4}}", timeout_s=5.0).correct
        (helper,) = verifier._all
        os.kill(helper.process.pid, signal.SIGSTOP)
        start = time.monotonic()
        verdict = verifier.verify("2", "\\boxed{\\sqrt{4}}", timeout_s=0.5)
        assert time.monotonic() - start < 0.5 + KILL_GRACE_S + 10.0  # its limit, not forever (a hang guard)
        assert verdict.timed_out and verdict.killed and not verdict.correct
        assert helper.process.poll() is not None  # reaped, not left behind
        assert verifier.verify("2", "\\boxed{\\sqrt{4}}", timeout_s=5.0).correct  # a fresh helper
    finally:
        verifier.close()


def test_concurrent_calls_from_threads():
    completions = [f"\\boxed{{\\frac{{{2 * i}}}{{{2 * (i + 1)}}}}}" for i in range(1, 9)]
    answers = [f"\\frac{{{i}}}{{{i + 1}}}" for i in range(1, 9)]
    results = [None] * len(completions)

    def run(i):
        results[i] = math_answer(completions[i], answer=answers[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(completions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [1.0] * len(completions)


def test_exact_match():
    assert exact_match("  Paris\n", answer="Paris") == 1.0
    assert exact_match("paris", answer="Paris") == 0.0
    assert exact_match("", answer="Paris") == 0.0


def test_boxed_format():
    assert boxed_format("so \\boxed{3}") == 1.0
    assert boxed_format("so \\boxed{ }") == 0.0
    assert boxed_format("so 3") == 0.0


def test_length_penalty():
    # ramp from max - buffer = 6 to max = 10: length 8 -> -(8 - 6) / 4 = -0.5
    assert length_penalty("x" * 6, max_chars=10, buffer_chars=4) == 0.0
    assert length_penalty("x" * 8, max_chars=10, buffer_chars=4) == -0.5
    assert length_penalty("x" * 50, max_chars=10, buffer_chars=4) == -1.0
    with pytest.raises(ValueError, match="buffer_chars"):
        length_penalty("x", max_chars=10, buffer_chars=0)


def test_helper_outlives_the_thread_that_started_it():
    """Helpers die with their parent *thread* (PR_SET_PDEATHSIG); they must be started by a lasting one."""
    verifier = MathVerifier(max_helpers=1)
    try:
        thread = threading.Thread(target=verifier.verify, args=("2", "\\boxed{\\sqrt{4}}"))
        thread.start()
        thread.join(timeout=60)
        (helper,) = verifier._all
        time.sleep(0.2)
        assert helper.process.poll() is None  # still alive after its first caller's thread ended
        verdict = verifier.verify("2", "\\boxed{\\sqrt{4}}")
        assert verdict.correct and not verdict.killed
    finally:
        verifier.close()


def test_a_helper_that_died_idle_is_replaced_not_reported_as_a_timeout():
    verifier = MathVerifier(max_helpers=1)
    try:
        assert verifier.verify("2", "\\boxed{\\sqrt{4}}").correct
        (helper,) = verifier._all
        helper.process.kill()
        helper.process.wait()
        verdict = verifier.verify("2", "\\boxed{\\sqrt{4}}")
        assert verdict.correct and not verdict.timed_out  # was: a killed helper's "timed out", reward 0
        assert verifier._all and helper not in verifier._all
    finally:
        verifier.close()


def test_close_ends_helpers_still_starting_and_the_verifier_stays_usable():
    verifier = MathVerifier(max_helpers=2)
    verifier.start_helpers()
    starting = list(verifier._idle.queue)
    verifier.close()  # while they import math-verify (~1 s)
    started = [slot.result() for slot in starting if not slot.cancelled()]
    deadline = time.monotonic() + 10
    while any(h.process.poll() is None for h in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(h.process.poll() is not None for h in started)  # none left running until exit
    assert not verifier._all
    try:
        assert verifier.verify("2", "\\boxed{\\sqrt{4}}").correct  # a new helper
    finally:
        verifier.close()


def test_start_helpers_starts_them_in_the_background_and_verify_uses_them(monkeypatch):
    """`start_helpers` returns at once; the helpers it started serve the first verifications (none is started
    in `verify`), and calling it again starts none."""
    from rollflow.rewards import math_verifier

    verifier = MathVerifier(max_helpers=2)
    spawned = []
    real_spawn, real_helper = math_verifier._spawn_helper, math_verifier._Helper
    release = threading.Event()

    def spawn():
        spawned.append(threading.current_thread().name)
        return real_spawn()

    def held_helper():  # no helper starts before the test says so
        assert release.wait(60), "start_helpers waited for its helpers"
        return real_helper()

    monkeypatch.setattr(math_verifier, "_spawn_helper", spawn)
    monkeypatch.setattr(math_verifier, "_Helper", held_helper)
    try:
        verifier.start_helpers()  # returns although none of its helpers can start yet
        verifier.start_helpers()
        release.set()
        assert len(spawned) == 2
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            verifier.verify("1/2", "\\boxed{\\frac{2}{4}}").correct)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == [True] * 4
        assert len(spawned) == 2 and len(verifier._all) == 2  # the background ones, no more
    finally:
        verifier.close()


def test_a_run_warms_up_the_rewards_it_uses(monkeypatch):
    """`warm_up_rewards`: math_answer starts its helpers; others, unknown names and dotted paths are skipped."""
    from rollflow.rewards import math_verifier
    from rollflow.rewards.registry import warm_up_rewards

    calls = []
    monkeypatch.setattr(math_verifier.MathVerifier, "start_helpers", lambda self: calls.append(self))
    warm_up_rewards(["exact_match", "my.module:score", "nope"])
    assert calls == []
    warm_up_rewards(["math_answer", "exact_match", "math_answer"])
    assert calls == [math_verifier.default_verifier()]
