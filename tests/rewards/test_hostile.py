"""The hostile-program suite: what a policy under RL pressure may write, run through the sandbox.

Each program prints its expected output only if it behaves honestly (or, for an attack, prints ESCAPED
only if the attack worked). For every program we check: the reward is what an honest grader would give
(0 for attacks and for programs that hit a limit), the run ends within its wall limit, no process of the
run survives, its working directory is gone, files outside it are untouched, and secrets stay secret.
The whole module runs with the test process inside a pids + memory cgroup (`caged_test_process`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

import pytest

from rollflow.rewards.code import StdioCase, run_stdio_case
from rollflow.rewards.sandbox import Sandbox, SandboxLimits
from rollflow.rewards.sandbox_isolation import detect_isolation
from rollflow.rewards.sandbox_processes import processes_of_uid

LIMITS = SandboxLimits(
    wall_time_s=2.0,
    cpu_time_s=2.0,
    memory_bytes=256 << 20,
    max_processes=16,
    max_output_bytes=64 << 10,
    max_file_bytes=8 << 20,
    tmp_bytes=16 << 20,
)
SLACK_S = 20.0  # start-up, cleanup and a loaded 2-core machine: a hang guard (the attacks run 60 s and more)
SECRET = "rollflow-hostile-secret-4b1d"

pytestmark = [
    pytest.mark.skipif(
        detect_isolation() != "bwrap", reason="hostile suite needs bubblewrap (apt-get install bubblewrap)"
    ),
    pytest.mark.usefixtures("caged_test_process"),
]


@dataclass(frozen=True)
class Hostile:
    name: str
    source: str  # may use {canary_dir}, {canary_file}, {tcp_port}, {udp_port}, {test_pid}
    expected_output: str  # what the program prints when it behaves (attacks print ESCAPED on success)
    honest_passes: bool = False  # True: a harmless program whose honest result earns the reward
    stdin: str = ""


ATTACK = "ESCAPED"

HOSTILE = [
    Hostile("infinite_loop", "while True:\n    pass", ATTACK),
    Hostile("sleep_past_limit", "import time\ntime.sleep(60)\nprint('ESCAPED')", ATTACK),
    Hostile(
        "fork_bomb",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        ATTACK,
    ),
    Hostile(
        "fork_bomb_exec",
        "import subprocess\nwhile True:\n    try:\n        subprocess.Popen(['sleep', '1000'])\n    except OSError:\n        pass",
        ATTACK,
    ),
    Hostile("memory_bomb_at_once", "x = bytearray(8 << 30)\nprint('ESCAPED')", ATTACK),
    Hostile(
        "memory_bomb_gradual", "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))", ATTACK
    ),
    Hostile(
        "memory_bomb_in_children",
        "import os\nfor _ in range(8):\n    if os.fork() == 0:\n        x = bytearray(200 << 20)\n        os._exit(0)\n"
        "statuses = [os.wait()[1] for _ in range(8)]\nprint('ESCAPED' if all(s == 0 for s in statuses) else 'contained')",
        ATTACK,
    ),
    Hostile(
        "thread_bomb",
        "import threading, time\nn = 0\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n"
        "    n += 1\n    if n == 5000:\n        print('ESCAPED')",
        ATTACK,
    ),
    Hostile("stdout_flood", "while True:\n    print('x' * 1000)", ATTACK),
    Hostile("stderr_flood", "import sys\nwhile True:\n    sys.stderr.write('x' * 1000)", ATTACK),
    Hostile("one_giant_line", "import sys\nsys.stdout.write('x' * (200 << 20))", ATTACK),
    Hostile(
        "deep_recursion",
        "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)\nprint('ESCAPED')",
        ATTACK,
    ),
    Hostile(
        "write_outside_workdir",
        "paths = ['{canary_dir}/pwned', '/usr/pwned', '/pwned', '/root/pwned', '/dev/shm/../pwned', '../pwned', '/proc/pwned']\n"
        "for p in paths:\n    try:\n        open(p, 'w').write('x')\n        print('ESCAPED', p)\n    except OSError:\n        pass",
        ATTACK,
    ),
    Hostile(
        "delete_files",
        "import os, shutil\nfor p in ['{canary_file}', '/usr/bin/env']:\n    try:\n        os.remove(p)\n        print('ESCAPED', p)\n"
        "    except OSError:\n        pass\nshutil.rmtree('{canary_dir}', ignore_errors=True)\nshutil.rmtree('/usr', ignore_errors=True)",
        ATTACK,
    ),
    Hostile(
        "env_secret",
        "import os\nprint(os.environ.get('ROLLFLOW_HOSTILE_SECRET', 'no secret'))",
        "no secret",
        honest_passes=True,
    ),
    Hostile(
        "proc_environ_secret",
        "import glob\nfor p in glob.glob('/proc/*/environ'):\n    try:\n        if b'ROLLFLOW_HOSTILE_SECRET' in open(p, 'rb').read():\n"
        "            print('ESCAPED', p)\n    except OSError:\n        pass",
        ATTACK,
    ),
    Hostile(
        "read_host_files",
        "for p in ['/etc/shadow', '/etc/passwd', '/root/.bash_history', '{canary_file}', '/proc/{test_pid}/environ']:\n"
        "    try:\n        open(p).read()\n        print('ESCAPED', p)\n    except OSError:\n        pass",
        ATTACK,
    ),
    Hostile(
        "network_outside",
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    print('ESCAPED')\nexcept OSError:\n    pass",
        ATTACK,
    ),
    Hostile(
        "network_loopback_tcp",
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {tcp_port}), timeout=1).sendall(b'pwned')\n    print('ESCAPED')\n"
        "except OSError:\n    pass",
        ATTACK,
    ),
    Hostile(
        "network_loopback_udp",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor _ in range(5):\n    try:\n"
        "        s.sendto(b'pwned', ('127.0.0.1', {udp_port}))\n    except OSError:\n        pass",
        ATTACK,
    ),
    Hostile(
        "dns_lookup",
        "import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\n    print('ESCAPED')\nexcept OSError:\n    pass",
        ATTACK,
    ),
    Hostile(
        "kill_the_caller",
        "import os, signal\nfor pid in ({test_pid}, os.getppid(), 1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n        pass\nos.kill(-1, signal.SIGKILL)\nprint('ESCAPED')",
        ATTACK,
    ),
    Hostile(
        "kill_own_group",
        "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)\nprint('ESCAPED')",
        ATTACK,
    ),
    Hostile(
        "detached_double_fork",
        "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        sys.stdout.close()\n"
        "        time.sleep(1000)\n    os._exit(0)\nos.wait()\nprint('parent done')",
        "parent done",
        honest_passes=True,
    ),
    Hostile(
        "daemon_popen",
        "import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True, stdout=subprocess.DEVNULL)\nprint('spawned')",
        "spawned",
        honest_passes=True,
    ),
    Hostile(
        "ignore_signals",
        "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n    signal.signal(s, signal.SIG_IGN)\n"
        "while True:\n    pass",
        ATTACK,
    ),
    Hostile(
        "become_root",
        "import os\ntry:\n    os.setuid(0)\n    print('ESCAPED')\nexcept OSError:\n    pass",
        ATTACK,
    ),
    Hostile(
        "cpu_burn_processes",
        "import multiprocessing\ndef burn(_):\n    while True:\n        pass\n"
        "if __name__ == '__main__':\n    multiprocessing.Pool(4).map(burn, range(4))",
        ATTACK,
    ),
    Hostile(
        "disk_fill_one_file",
        "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))\nprint('ESCAPED')",
        ATTACK,
    ),
    Hostile(
        "tmp_fill_many_files",
        "i = 0\ntry:\n    while True:\n        with open(f'/tmp/f{{i}}', 'wb') as f:\n            f.write(b'x' * 4096)\n        i += 1\nexcept OSError:\n    print('full')",
        "full",
        honest_passes=True,
    ),
    Hostile("ignores_big_stdin", "print('ok')", "ok", honest_passes=True, stdin="x" * (8 << 20)),
    Hostile("closes_output_and_loops", "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass", ATTACK),
    Hostile(
        "honest_sum",
        "a, b = map(int, input().split())\nprint(a + b)",
        "5",
        honest_passes=True,
        stdin="2 3\n",
    ),
]


def test_suite_is_big_enough():
    assert len(HOSTILE) >= 25
    assert len({h.name for h in HOSTILE}) == len(HOSTILE)
    assert WAIT_OUT_A_LIMIT <= {h.name for h in HOSTILE}  # each name marks a program of the suite slow


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Host-side canaries, listeners and a secret in the environment."""
    root = tmp_path_factory.mktemp("hostile")
    canary_dir = root / "canary"
    canary_dir.mkdir()
    os.chmod(canary_dir, 0o777)  # only the sandbox's mount isolation protects it, not permissions
    canary_file = canary_dir / "keep.txt"
    canary_file.write_text("keep")
    os.chmod(canary_file, 0o666)
    workdirs = root / "workdirs"
    workdirs.mkdir()

    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.settimeout(0.05)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.05)
    received: list[bytes] = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                conn, _ = tcp.accept()
                received.append(b"tcp")
                conn.close()
            except OSError:
                pass
            try:
                received.append(udp.recv(64))
            except OSError:
                pass

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    os.environ["ROLLFLOW_HOSTILE_SECRET"] = SECRET
    sandbox = Sandbox(LIMITS, max_parallel=2, workdir_root=str(workdirs))
    yield {
        "sandbox": sandbox,
        "canary_dir": canary_dir,
        "canary_file": canary_file,
        "workdirs": workdirs,
        "received": received,
        "format": {
            "canary_dir": str(canary_dir),
            "canary_file": str(canary_file),
            "tcp_port": tcp.getsockname()[1],
            "udp_port": udp.getsockname()[1],
            "test_pid": os.getpid(),
        },
    }
    stop.set()
    listener.join(timeout=5)
    tcp.close()
    udp.close()
    del os.environ["ROLLFLOW_HOSTILE_SECRET"]


# Programs the sandbox stops only at their wall or CPU limit (2 s each, whatever the machine): the slow
# tier's, but for `infinite_loop`, which keeps a limit's kill and cleanup in the fast one.
WAIT_OUT_A_LIMIT = {"sleep_past_limit", "fork_bomb", "fork_bomb_exec", "deep_recursion", "ignore_signals",
                    "delete_files", "closes_output_and_loops"}


@pytest.mark.parametrize("case", [pytest.param(h, marks=pytest.mark.slow) if h.name in WAIT_OUT_A_LIMIT else h
                                  for h in HOSTILE], ids=[h.name for h in HOSTILE])
def test_hostile_program_is_contained(host, case):
    sandbox: Sandbox = host["sandbox"]
    source = case.source.format(**host["format"])
    seen_uids: list[int] = []
    original_run = sandbox._run

    def recording_run(*args, **kwargs):
        result = original_run(*args, **kwargs)
        seen_uids.append(result.uid)
        return result

    sandbox._run = recording_run  # type: ignore[method-assign]
    try:
        start = time.monotonic()
        passed = run_stdio_case(sandbox, source, StdioCase(case.stdin, case.expected_output), LIMITS)
        elapsed = time.monotonic() - start
    finally:
        del sandbox._run

    # Reward: an attack earns 0; a harmless program earns its honest result.
    assert passed is case.honest_passes
    # Ends within its limit.
    assert elapsed < LIMITS.wall_time_s + SLACK_S, elapsed
    # No process left behind (private uid), no working directory left, nothing written outside it.
    (uid,) = seen_uids
    assert processes_of_uid(uid) == []
    assert list(host["workdirs"].iterdir()) == []
    assert sorted(p.name for p in host["canary_dir"].iterdir()) == ["keep.txt"]
    assert host["canary_file"].read_text() == "keep"
    for shared in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not os.path.exists(os.path.join(shared, "pwned"))
        assert not os.path.exists(os.path.join(shared, "big"))
    assert os.path.exists("/usr/bin/env")
    # Nothing reached the host's loopback listeners.
    assert host["received"] == []


def test_the_caller_survives_and_the_pool_still_works(host):
    result = host["sandbox"].run_python("print(6 * 7)")
    assert result.ok and result.stdout == b"42\n"
    assert SECRET not in result.stdout.decode()
