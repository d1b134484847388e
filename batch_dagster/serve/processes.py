"""Child processes that start and stop together: each leads its own process group, so nothing outlives us. A parent
killed (SIGKILL, to it or to its whole process group) takes them with it twice over: Linux's parent-death signal
kills each child at once, and a watcher outside the parent's group (engine/orphans.py) kills each child's group,
which holds what the child started (a vLLM server's engine core and worker)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from batch_dagster.engine import orphans

log = logging.getLogger("batch_dagster.serve.processes")
GRACE_S = 20.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dies_with_us() -> Callable[[], None] | None:
    """A preexec_fn that has the child killed (SIGKILL) when this process dies, however it dies; None where that cannot
    be had: off Linux, or off the main thread.

    Linux sends the parent-death signal when the thread that forked the child ends, not the process: only the main
    thread lives as long as the process. The signal survives exec (taskset, then vLLM), not fork: the child's own
    children are the watcher's (engine/orphans.py). A parent that died before the child asked for it is seen by the
    child's parent pid, and the child ends there.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Children:
    """Child processes, each the leader of its own process group."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.watchers: dict[str, subprocess.Popen | None] = {}

    def start(self, name: str, command: list[str], env: dict[str, str], log_file: IO[bytes] | None = None) -> None:
        """Start `command` in its own process group; its output goes to `log_file` when given."""
        log.info("starting %s: %s", name, " ".join(command))
        self.procs[name] = subprocess.Popen(command, env=env, start_new_session=True, stdout=log_file,
                                            stderr=subprocess.STDOUT if log_file is not None else None,
                                            preexec_fn=dies_with_us())
        log.info("%s has pid %d", name, self.procs[name].pid)
        # Its own process group keeps it from our terminal's Ctrl-C (stop() stops it in order). When we die without
        # stopping it (kill -9, to us or to our group), the parent-death signal kills it and the watcher its group:
        # a vLLM server and its engine core would otherwise hold their memory and ports.
        orphans.release(self.watchers.get(name))  # a restarted child's first watcher: its child is gone
        self.watchers[name] = orphans.watch([self.procs[name].pid])

    def exited(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, grace_s: float = GRACE_S, names: list[str] | None = None) -> None:
        """SIGINT every group (of `names`; None: all), wait for every member to go, then SIGKILL the groups still
        there. The stopped children are forgotten when `names` are given."""
        procs = {name: p for name, p in self.procs.items() if names is None or name in names}
        for name, proc in procs.items():
            log.info("stopping %s (process group %d)", name, proc.pid)
            signal_group(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for proc in procs.values():
                proc.poll()
            if not any(orphans.group_alive(p.pid) for p in procs.values()):
                break
            time.sleep(0.2)
        for name, proc in procs.items():
            if orphans.group_alive(proc.pid):
                log.warning("%s did not stop within %.0fs; killing its process group", name, grace_s)
                signal_group(proc.pid, signal.SIGKILL)
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                log.error("pid %d did not exit after SIGKILL", proc.pid)
        for name in procs:
            orphans.release(self.watchers.pop(name, None))
        if names is not None:
            for name in procs:
                del self.procs[name]
