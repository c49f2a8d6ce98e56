"""The processes of one sandbox run: feeding and reading them under limits, and killing all of them.

`communicate` enforces the run's wall time and output size; `kill_uid` sweeps every process of the run's
private uid, wherever it escaped to.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time


def count_own_tasks() -> int:
    """Tasks (processes and threads) of our uid: RLIMIT_NPROC counts them all for a non-root user."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def processes_of_uid(uid: int) -> list[int]:
    """Pids of the live (non-zombie) processes whose owner is `uid`, from /proc.

    Args:
        uid: a user id.

    Returns:
        The pids.
    """
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except OSError:
            continue
        if state not in (b"Z", b"X"):
            pids.append(int(entry))
    return pids


def kill_uid(uid: int, deadline_s: float = 10.0) -> None:
    """SIGKILL every process of the run's private uid until none is left (or `deadline_s` passes).

    `kill(-1)` from that uid reaches exactly its processes, wherever they are, in one system call; it
    catches descendants that escaped the namespace or cgroup cleanup (or had none, at level "rlimits").
    """
    end = time.monotonic() + deadline_s
    while processes_of_uid(uid) and time.monotonic() < end:
        subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-9", "-1"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin"},
            timeout=30,
        )
        time.sleep(0.005)


def communicate(
    process: subprocess.Popen, stdin: bytes, wall_time_s: float, max_output_bytes: int
) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin and collect capped output until exit or a limit; kill the process group on a limit.

    Args:
        process: started with stdin, stdout and stderr pipes, in a session of its own.
        stdin: what to feed it.
        wall_time_s: the run is killed after this many seconds.
        max_output_bytes: stdout and stderr are each cut here, and the run is killed.

    Returns:
        (stdout, stderr, timed_out, output_limited).
    """
    assert process.stdin and process.stdout and process.stderr
    deadline = time.monotonic() + wall_time_s
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    outputs = {out_fd: bytearray(), err_fd: bytearray()}
    timed_out = output_limited = False
    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(process.stdin.fileno(), False)
            selector.register(process.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            process.stdin.close()
        open_outputs = len(outputs)
        while open_outputs and not output_limited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            exited = process.poll() is not None
            events = selector.select(min(remaining, 0.05 if exited else 0.1))  # wake up to notice an exit
            if exited and not events:
                break  # the program is gone; a descendant that kept its pipes open is not waited for
            for key, _ in events:
                if key.fd in outputs:
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fd)
                        open_outputs -= 1
                        continue
                    buffer = outputs[key.fd]
                    buffer += chunk[: max_output_bytes + 1 - len(buffer)]
                    if len(buffer) > max_output_bytes:
                        del buffer[max_output_bytes:]
                        output_limited = True
                else:
                    try:
                        written = os.write(key.fd, pending[:65536])
                        pending = pending[written:]
                    except OSError:  # the program closed its stdin or exited
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(key.fd)
                        process.stdin.close()
    if not (timed_out or output_limited):
        try:  # both outputs are closed; the program may still be running
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out or output_limited:
        _kill_group(process)
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if not pipe.closed:
            pipe.close()
    return bytes(outputs[out_fd]), bytes(outputs[err_fd]), timed_out, output_limited


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.kill()
    except ProcessLookupError:
        pass
