"""math-verify in helper processes, so a pathological expression can never stall the caller.

Why processes: math-verify bounds its work with `signal.alarm`, which only works in the main thread of
the main interpreter, and rewards run in worker threads and Ray actors. Worse, an expression such as
`\\boxed{9^{9^{9^{9}}}}` makes sympy compute a huge integer inside one C call, which no signal and no
thread trick can interrupt. So we turn math-verify's own timeouts off and run parse + verify in a few
long-lived helper processes (started lazily, warm caches, one JSON line per request over a pipe). Each
helper bounds a request with its own `setitimer` alarm (it *is* a main thread), which ends slow pure-Python
work cheaply; the caller waits at most `timeout_s + KILL_GRACE_S` and otherwise kills the helper
(SIGKILL) and starts a fresh one on next use. A helper also caps its address space and dies with its parent.

A helper loads this file by itself (`HELPER_PROGRAM`), not as part of the rollflow package: it imports
math-verify and the standard library, nothing of rollflow's (~4 MB and ~0.15 s less per helper).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KILL_GRACE_S = 0.5  # how long past its own alarm we wait for a helper before killing it
STARTUP_TIMEOUT_S = 60.0  # importing sympy + math-verify on a loaded 2-core machine
HELPER_MEMORY_BYTES = 2 << 30  # address-space cap for a helper: a runaway bigint fails with MemoryError
# The helper's program: this file as a module of its own (registered, so its dataclasses resolve). argv: file.
HELPER_PROGRAM = ("import importlib.util, sys\n"
                  "spec = importlib.util.spec_from_file_location('rollflow_math_verify_helper', sys.argv[1])\n"
                  "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
                  "spec.loader.exec_module(module)\n"
                  "module._helper_main()\n")


@dataclass
class Verdict:
    """The outcome of one verification.

    Attributes:
        correct: math-verify judged the prediction equal to the gold answer.
        timed_out: the request hit its time limit (then `correct` is False).
        killed: the helper did not answer in time and was killed (its alarm could not interrupt the work).
        error: a one-line description when the helper failed for another reason.
    """

    correct: bool
    timed_out: bool = False
    killed: bool = False
    error: str | None = None


class _Helper:
    """One helper process and its pipes; used by one thread at a time."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
        env["PYTHONUNBUFFERED"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-c", HELPER_PROGRAM, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self._buffer = b""
        line = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        if line is None or json.loads(line).get("ready") is not True:
            self.kill()
            raise RuntimeError("math-verify helper process failed to start")

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the helper's stdout, or None if the deadline passes or the helper dies."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # helper exited
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def request(self, gold: str, prediction: str, timeout_s: float) -> Verdict | None:
        """Send one request; None means the helper is unusable (timed out or died) and must be killed."""
        assert self.process.stdin is not None
        payload = json.dumps({"gold": gold, "prediction": prediction, "timeout_s": timeout_s})
        try:
            self.process.stdin.write(payload.encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = self._read_line(time.monotonic() + timeout_s + KILL_GRACE_S)
        if line is None:
            return None
        reply = json.loads(line)
        return Verdict(
            correct=bool(reply["correct"]), timed_out=bool(reply.get("timed_out")), error=reply.get("error")
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


_spawn_requests: queue.SimpleQueue[Future] = queue.SimpleQueue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawner_loop() -> None:
    while True:
        future = _spawn_requests.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(_Helper())
            except BaseException as error:
                future.set_exception(error)


def _spawn_helper() -> Future:
    """Have a helper start from one long-lived daemon thread; the future's result is the started helper.

    The helper asks Linux to kill it when its parent dies (PR_SET_PDEATHSIG), and Linux means the parent
    *thread*: started from a short-lived worker thread, it would be killed when that thread ends.
    """
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawner_loop, name="rollflow-math-spawner", daemon=True)
            _spawner.start()
    future: Future = Future()
    _spawn_requests.put(future)
    return future


class MathVerifier:
    """A bounded, thread-safe set of math-verify helper processes.

    Args:
        max_helpers: at most this many helper processes (and so concurrent verifications).
    """

    def __init__(self, max_helpers: int = 2):
        if max_helpers < 1:
            raise ValueError(f"max_helpers must be >= 1, got {max_helpers}")
        # a slot: an idle helper, None (started on first use) or a Future of one starting (`start_helpers`)
        self._idle: queue.LifoQueue[_Helper | Future | None] = queue.LifoQueue()
        for _ in range(max_helpers):
            self._idle.put(None)
        self._all: set[_Helper] = set()
        self._lock = threading.Lock()

    def start_helpers(self) -> None:
        """Start the helpers not started yet, in the background, and return at once: the first verifications
        then find them up instead of waiting ~1 s each for one to import math-verify (a run calls this while
        its workers start). A helper that fails to start is started again on first use."""
        slots = self._take_idle_slots()
        for slot in slots:
            if slot is None:
                slot = _spawn_helper()
                slot.add_done_callback(self._track)
            self._idle.put(slot)

    def _take_idle_slots(self) -> list[_Helper | Future | None]:
        """Every slot not in use now, taken out of the idle queue (the caller puts each back)."""
        slots = []
        while True:
            try:
                slots.append(self._idle.get_nowait())
            except queue.Empty:
                return slots

    def _track(self, future: Future) -> None:
        if _started(future):
            with self._lock:
                self._all.add(future.result())

    def verify(self, gold: str, prediction: str, timeout_s: float = 5.0) -> Verdict:
        """Parse both texts with math-verify and compare them, within `timeout_s`.

        Args:
            gold: the reference answer, as LaTeX or plain text (wrapped in `$...$` if it has no delimiters).
            prediction: the model's completion.
            timeout_s: time limit for parse + verify; the request is abandoned (and its helper killed)
                at `timeout_s + KILL_GRACE_S` at the latest.

        Returns:
            The verdict; a timeout or helper failure gives `correct=False`, never an exception.
        """
        helper = self._idle.get()
        try:
            if isinstance(helper, Future):  # started by `start_helpers`
                helper = helper.result() if _started(helper) else None
            if helper is not None and helper.process.poll() is not None:  # died idle (killed, OOM, `close`)
                self._discard(helper)
                helper = None
            if helper is None:
                helper = _spawn_helper().result()
                with self._lock:
                    self._all.add(helper)
            verdict = helper.request(gold, prediction, timeout_s)
            if verdict is None:
                self._discard(helper)
                helper = None
                return Verdict(False, timed_out=True, killed=True)
            return verdict
        finally:
            self._idle.put(helper)

    def _discard(self, helper: _Helper) -> None:
        helper.kill()
        with self._lock:
            self._all.discard(helper)

    def close(self) -> None:
        """Kill every helper process: idle and busy ones now (a busy one's verification fails), one still
        starting (`start_helpers`) once it is up. A later `verify` starts new ones."""
        slots = self._take_idle_slots()
        with self._lock:
            helpers = list(self._all)
            self._all.clear()
        for slot in slots:
            if isinstance(slot, Future) and not slot.cancel():  # being started: kill it when it is up
                slot.add_done_callback(self._kill_started)
            self._idle.put(None)
        for helper in helpers:
            helper.kill()

    def _kill_started(self, future: Future) -> None:
        if _started(future):
            self._discard(future.result())


def _started(future: Future) -> bool:
    """Whether a done helper future holds a started helper: not cancelled (`close` cancels one that has not
    begun starting, and runs its done callbacks, where `exception()` would raise `CancelledError`), not failed."""
    return not future.cancelled() and future.exception() is None


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier (two helpers), created on first use and closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier(max_helpers=min(2, os.cpu_count() or 1))
            atexit.register(_default.close)
        return _default


def _forget_after_fork() -> None:
    """A forked child must not share its parent's helper pipes; it starts its own helpers on first use."""
    global _default, _default_lock, _spawner, _spawner_lock
    _default = None
    _default_lock = threading.Lock()
    _spawner = None  # threads do not survive fork
    _spawner_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------------------------------------------------
# Helper process side.


class _Deadline(BaseException):
    """Raised by the helper's alarm; a BaseException so math-verify's `except Exception` cannot eat it."""


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this helper when its parent exits (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 == PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wrap_gold(gold: str) -> str:
    """math-verify finds LaTeX only between delimiters; a bare `\\frac{1}{2}` gold needs `$...$`."""
    if "$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold:
        return gold
    return f"${gold}$"


def _helper_main() -> None:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (HELPER_MEMORY_BYTES, HELPER_MEMORY_BYTES))
    logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off; that is on purpose
    from math_verify import parse, verify

    def on_alarm(signum, frame):
        raise _Deadline

    signal.signal(signal.SIGALRM, on_alarm)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        reply: dict[str, object] = {"correct": False}
        try:
            signal.setitimer(signal.ITIMER_REAL, float(request["timeout_s"]))
            try:
                gold = parse(_wrap_gold(request["gold"]), parsing_timeout=None)
                prediction = parse(request["prediction"], parsing_timeout=None)
                reply["correct"] = bool(verify(gold, prediction, timeout_seconds=None))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:
            reply["timed_out"] = True
        except MemoryError:
            reply["error"] = "MemoryError"
        except Exception as error:  # a math-verify bug must not end the helper
            reply["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        out.write(json.dumps(reply) + "\n")
        out.flush()

