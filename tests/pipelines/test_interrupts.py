import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rollflow.pipelines.interrupts import Interrupted, StopSignals


def _signal_self(number=signal.SIGINT):
    os.kill(os.getpid(), number)
    time.sleep(0.01)  # the handler runs here at the latest


def test_a_signal_raises_at_once_outside_critical_sections():
    with StopSignals() as stop, pytest.raises(Interrupted) as interrupted:
        _signal_self(signal.SIGINT)
        pytest.fail("not interrupted")
    assert interrupted.value.signal_name == "SIGINT" and interrupted.value.exit_status == 130
    assert stop.received == [signal.SIGINT]


def test_library_code_catching_exception_does_not_swallow_it():
    with StopSignals(), pytest.raises(Interrupted):
        try:
            _signal_self()
        except Exception:  # what a library's catch-all looks like
            pytest.fail("Interrupted is not an Exception")


def test_a_critical_section_finishes_before_the_signal_raises():
    done = []
    with StopSignals() as stop, pytest.raises(Interrupted) as interrupted:
        with stop.critical():
            _signal_self(signal.SIGTERM)
            done.append("train")
            with stop.critical():  # nested: still deferred until the outermost section ends
                done.append("sync")
            done.append("log")
        pytest.fail("the deferred signal did not raise when the section ended")
    assert done == ["train", "sync", "log"]
    assert interrupted.value.exit_status == 143


def test_a_second_signal_raises_inside_a_critical_section():
    done = []
    with StopSignals() as stop, pytest.raises(Interrupted):
        with stop.critical():
            _signal_self()
            done.append("after first")
            _signal_self()
            done.append("after second")
    assert done == ["after first"]
    assert stop.received == [signal.SIGINT, signal.SIGINT]


def test_an_error_in_a_critical_section_goes_on_past_a_deferred_signal():
    with StopSignals() as stop, pytest.raises(ValueError):
        with stop.critical():
            _signal_self()
            raise ValueError("the step failed")


def test_the_previous_handlers_come_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals():
        assert signal.getsignal(signal.SIGINT) != before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_outside_the_main_thread_it_installs_nothing():
    before, errors = signal.getsignal(signal.SIGINT), []

    def in_thread():
        try:
            with StopSignals() as stop, stop.critical():
                assert signal.getsignal(signal.SIGINT) == before
        except BaseException as err:  # noqa: BLE001 (reported to the main thread)
            errors.append(err)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(10)
    assert errors == []


DRIVER = """
import sys, time
from rollflow.pipelines.interrupts import Interrupted, StopSignals

try:
    with StopSignals() as stop:
        with stop.critical():
            print("step started", flush=True)
            deadline = time.monotonic() + 30
            while not stop.received and time.monotonic() < deadline:  # the signal lands in the step
                time.sleep(0.01)
            print("step finished", flush=True)
        time.sleep(30)
        print("not interrupted", flush=True)
except Interrupted as interrupted:
    print(f"interrupted by {interrupted.signal_name}", flush=True)
    sys.exit(interrupted.exit_status)
"""


def test_sigterm_lets_the_step_finish_then_exits_143():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline() == "step started\n"
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=30)
    assert out.splitlines() == ["step finished", "interrupted by SIGTERM"]
    assert driver.returncode == 143


def test_a_plain_keyboard_interrupt_after_a_signal_leaves_as_interrupted():
    """What `ray.get` raises when the handler fires while it waits: a plain KeyboardInterrupt."""
    with pytest.raises(Interrupted) as interrupted, StopSignals():
        try:
            _signal_self(signal.SIGTERM)
        except Interrupted:
            raise KeyboardInterrupt from None
    assert interrupted.value.exit_status == 143
    with pytest.raises(KeyboardInterrupt) as plain, StopSignals():  # no signal came: left as it is
        raise KeyboardInterrupt
    assert type(plain.value) is KeyboardInterrupt
