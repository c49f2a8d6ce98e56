"""A local Ray's head node without the processes a single-node run does not need (`lean_head_node`), and the
thread of the driver that does the work of the one left out whose work matters: forwarding the workers' output
to the console (`DriverLogMonitor`).

Imports only the standard library at the top (Ray inside the functions): a prestarted head imports it before
Ray.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator


class _HeadNode:
    skipped_log_monitor = False  # its work is the driver's to do (`DriverLogMonitor`)
    node = None  # the head node it built


@contextlib.contextmanager
def lean_head_node(warm_workers: int | None = None) -> Iterator[_HeadNode]:
    """Start a local Ray without the head processes a single-node run does not need: the autoscaler monitor
    (a fixed instance has nothing to scale), the dashboard's API server (no dashboard, job or state API is
    used), the Ray Client server (`ray start` starts one; nothing connects through it) and the log monitor
    (its work, forwarding workers' output to the console, runs as a thread of the driver instead:
    `DriverLogMonitor`). Each costs start-up CPU and 50-100 MB. `ray.init` has no option for
    any of them, so the head node is adjusted while `ray.init` builds it; with a Ray whose internals differ,
    nothing changes. With `warm_workers`, the raylet starts that many idle workers when it is up (Ray's default,
    where worker prestart is on, is one per CPU)."""
    head = _HeadNode()
    try:
        from ray._private import node, services
    except ImportError:
        yield head
        return
    try:
        from ray._private.log_monitor import LogMonitor  # noqa: F401 -- what the thread runs
    except ImportError:  # no thread to run it: keep Ray's process
        replace_log_monitor = False
    else:
        replace_log_monitor = True
    original_init, original_api_server = node.Node.__init__, node.Node.start_api_server
    original_log_monitor = node.Node.start_log_monitor
    original_start_process = services.start_ray_process

    def init(self, ray_params, *args, **kwargs):
        if hasattr(ray_params, "no_monitor"):
            ray_params.no_monitor = True
        if hasattr(ray_params, "ray_client_server_port"):  # `ray start` starts a Ray Client server: none used
            ray_params.ray_client_server_port = None
        head.node = self
        original_init(self, ray_params, *args, **kwargs)

    def start_api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard:
            return original_api_server(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)
        self._webui_url = None

    def start_log_monitor(self):
        head.skipped_log_monitor = True

    def start_ray_process(command, process_type, *args, **kwargs):
        if process_type == "raylet":
            flag = "--num_prestart_python_workers="
            command = [f"{flag}{warm_workers}" if part.startswith(flag) else part for part in command]
        return original_start_process(command, process_type, *args, **kwargs)

    node.Node.__init__, node.Node.start_api_server = init, start_api_server
    if replace_log_monitor:
        node.Node.start_log_monitor = start_log_monitor
    if warm_workers is not None:
        services.start_ray_process = start_ray_process
    try:
        yield head
    finally:
        node.Node.__init__, node.Node.start_api_server = original_init, original_api_server
        node.Node.start_log_monitor = original_log_monitor
        services.start_ray_process = original_start_process


class DriverLogMonitor(threading.Thread):
    """Ray's log monitor as a thread of the driver rather than a process of its own (~80 MB of RSS saved).

    It runs Ray's own `LogMonitor` (the same files tailed, the same messages published to the driver, which
    prints them as before: `(ActorTrainWorker pid=...) ...`), polling every 0.1 s while nothing is new, and
    ends with the Ray session (`stop`)."""

    POLL_S = 0.1

    def __init__(self, address_info: dict) -> None:
        super().__init__(name="rollflow-log-monitor", daemon=True)
        self._address_info = address_info
        self._stop_event = threading.Event()

    def run(self) -> None:
        from ray._private.log_monitor import LogMonitor, is_proc_alive
        from ray._raylet import GcsClient

        info = self._address_info
        try:
            monitor = LogMonitor(info["node_ip_address"], os.path.join(info["session_dir"], "logs"),
                                 GcsClient(address=info["gcs_address"]), is_proc_alive)
            names_updated = 0.0
            while not self._stop_event.is_set():
                if monitor.should_update_filenames(names_updated):
                    monitor.update_log_filenames()
                    names_updated = time.time()
                monitor.open_closed_files()
                if not monitor.check_log_files_and_publish_updates():
                    self._stop_event.wait(self.POLL_S)
            monitor.update_log_filenames()  # what the workers wrote since the last poll
            monitor.open_closed_files()
            monitor.check_log_files_and_publish_updates()
        except Exception as error:  # workers' output stops reaching the console; the run itself is unaffected
            if not self._stop_event.is_set():
                print(f"rollflow: workers' output no longer reaches this console ({type(error).__name__}: "
                      f"{error}); it is still written under {info.get('session_dir')}/logs", file=sys.stderr)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publish what is left of the workers' output, then end (before Ray shuts down its GCS)."""
        self._stop_event.set()
        self.join(timeout_s)
