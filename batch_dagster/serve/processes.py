"""Child processes that start and stop together: each leads its own process group, so nothing outlives us; and each
is watched (engine/orphans.py), so a parent killed with SIGKILL takes them (and their children) with it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import IO

from batch_dagster.engine import orphans

log = logging.getLogger("batch_dagster.serve.processes")
GRACE_S = 20.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Children:
    """Child processes, each the leader of its own process group."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], env: dict[str, str], log_file: IO[bytes] | None = None) -> None:
        """Start `command` in its own process group; its output goes to `log_file` when given."""
        log.info("starting %s: %s", name, " ".join(command))
        self.procs[name] = subprocess.Popen(command, env=env, start_new_session=True, stdout=log_file,
                                            stderr=subprocess.STDOUT if log_file is not None else None)
        log.info("%s has pid %d", name, self.procs[name].pid)
        # Its own process group keeps it from our terminal's Ctrl-C (stop() stops it in order); the watcher kills it
        # when we die without stopping it (kill -9): a vLLM server would otherwise hold its memory and ports.
        orphans.watch([self.procs[name].pid])

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
            if not any(_group_alive(p.pid) for p in procs.values()):
                break
            time.sleep(0.2)
        for name, proc in procs.items():
            if _group_alive(proc.pid):
                log.warning("%s did not stop within %.0fs; killing its process group", name, grace_s)
                signal_group(proc.pid, signal.SIGKILL)
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                log.error("pid %d did not exit after SIGKILL", proc.pid)
        if names is not None:
            for name in procs:
                del self.procs[name]
