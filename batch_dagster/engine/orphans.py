"""An engine's processes die with the process that holds the engine.

vLLM's engine core is a child process that lives on, idle, when its parent is killed (kill -9, the OOM
killer): it would keep its memory (and on a GPU its device memory) while the run's retry starts a new
engine. The same holds for the vLLM servers and routers `serve` and `batch-dagster fleet` start, each in a
process group of its own. `watch` starts a small watcher process that kills them once the holder is gone: each
watched process with its children, and the whole group of one that leads a group (a vLLM server's engine core and
worker are in the server's group, and outlive the server when it is killed first). The watcher runs this file as a
script, so it imports neither the package nor vLLM; it runs in a session of its own and ignores interrupts, so that
neither Ctrl-C at the holder's terminal nor a kill of the holder's whole process group takes it with the holder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

POLL_S = 1.0


def watch(pids: list[int]) -> subprocess.Popen[bytes] | None:
    """Kill `pids` (and their children, and the groups of those that lead one) once this process is gone; the watcher
    leaves when they all have (within POLL_S), or at `release`."""
    if not pids:
        return None
    watcher = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), *map(str, pids)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    # Reaped as soon as it leaves, so no zombie stays behind for the life of this process.
    threading.Thread(target=watcher.wait, daemon=True, name="engine-watcher").start()
    return watcher


def release(watcher: subprocess.Popen[bytes] | None) -> None:
    """End a watcher whose processes this process has stopped itself: it is gone when this returns, not up to POLL_S
    later, outliving the process that stopped them."""
    if watcher is not None:
        with contextlib.suppress(ProcessLookupError):
            watcher.kill()  # it ignores the other signals
        watcher.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process group still has a process (one of another user's counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(holder_pid: int, pids: list[int]) -> None:
    import psutil

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it leaves when the watched or the holder have
        signal.signal(sig, signal.SIG_IGN)

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    try:
        holder = psutil.Process(holder_pid)
    except psutil.NoSuchProcess:
        holder = None
    watched, groups = [], []
    for pid in pids:
        try:
            watched.append(psutil.Process(pid))  # is_running() later also checks it is the same process
            if os.getpgid(pid) == pid:  # while the group lives on, no new process gets its number
                groups.append(pid)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    while any(alive(p) for p in watched) or any(group_alive(g) for g in groups):
        if holder is None or not alive(holder):
            for p in watched:
                try:
                    for q in [*p.children(recursive=True), p]:
                        q.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            for g in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(g, signal.SIGKILL)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(a) for a in sys.argv[2:]])
