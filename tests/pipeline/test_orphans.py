"""An in-process engine's processes die with the process that holds it (engine/orphans.py), on stand-in processes.

The real engine is checked by tests/system/test_crash.py (a run worker killed mid-inference leaves no engine).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

from batch_dagster.engine import orphans
from tests.helpers import REPO

# A stand-in for a run worker: it starts an "engine" (a process with a child of its own, as vLLM's engine core
# has its model worker), has it watched, prints the engine's pid and lives on until killed.
HOLDER = """
import subprocess, sys, time
from batch_dagster.engine import orphans
engine = subprocess.Popen(["sh", "-c", sys.argv[1]])
orphans.watch([engine.pid])
print(engine.pid, flush=True)
engine.wait()  # reaped when it ends, as vLLM's shutdown reaps its engine
time.sleep(120)
"""


def _holder(engine_command: str) -> tuple[subprocess.Popen, psutil.Process]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, engine_command], stdout=subprocess.PIPE, text=True,
                              env=env)
    assert holder.stdout is not None
    return holder, psutil.Process(int(holder.stdout.readline()))


def _watcher(holder: subprocess.Popen) -> psutil.Process:
    deadline = time.time() + 10
    while time.time() < deadline:
        for p in psutil.Process(holder.pid).children():
            if any(arg.endswith("orphans.py") for arg in p.cmdline()):
                return p
        time.sleep(0.05)
    raise AssertionError("no watcher started")


def test_a_killed_holder_takes_its_engine_and_the_engines_children_with_it():
    holder, engine = _holder("sleep 120 & wait")
    try:
        deadline = time.time() + 10
        while not engine.children() and time.time() < deadline:
            time.sleep(0.05)
        family = [engine, *engine.children(recursive=True)]
        assert len(family) == 2
        holder.kill()  # kill -9: no exit handler of the holder runs
        holder.wait()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, alive
    finally:
        holder.kill()
        for p in psutil.Process().children(recursive=True):
            p.kill()


def test_the_watcher_leaves_once_the_engine_is_stopped_and_spares_the_holder():
    holder, engine = _holder("sleep 1")
    try:
        watcher = _watcher(holder)
        engine.wait(10)  # the engine ends on its own, as when it is shut down
        watcher.wait(10)
        assert holder.poll() is None  # the holder lives on, untouched
    finally:
        holder.kill()
        holder.wait()


def test_a_run_started_in_the_background_keeps_sigterm_for_its_steps_helpers():
    import signal

    from dagster._utils.interrupts import setup_interrupt_handlers

    from batch_dagster.defs.dagster_internals import interruptible

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `nohup ... &` starts a process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        interruptible()
        setup_interrupt_handlers()  # what Dagster does when it executes a job
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # children can still be terminated
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


# A stand-in for `serve` or `batch-dagster fleet`: it starts a "server" (with a child, as a vLLM server has its
# engine core) in a process group of its own, as serve/processes.py does, prints its pid and lives on.
SERVE = """
import signal, sys, time
from batch_dagster.serve.processes import Children
signal.signal(signal.SIGINT, signal.SIG_IGN)  # slow to stop: the test kills it with SIGKILL after a Ctrl-C
children = Children()
children.start("server", ["sh", "-c", "sleep 120 & wait"], env={"PATH": "/usr/bin:/bin"})
print(children.procs["server"].pid, flush=True)
time.sleep(120)
"""


def test_a_serve_killed_after_a_ctrl_c_takes_its_servers_and_their_children_with_it():
    import signal

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)  # its own terminal group, as a shell's foreground job
    family: list[psutil.Process] = []
    try:
        assert serve.stdout is not None
        server = psutil.Process(int(serve.stdout.readline()))
        deadline = time.time() + 10
        while not server.children() and time.time() < deadline:
            time.sleep(0.05)
        family = [server, *server.children(recursive=True)]
        assert len(family) == 2 and os.getpgid(server.pid) != os.getpgid(serve.pid)
        _watcher(serve)
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C: the terminal's group (the server's group is not in it)
        time.sleep(0.5)
        serve.kill()  # then kill -9
        serve.wait()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, alive
    finally:
        serve.kill()
        for p in [*family, *psutil.Process().children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _serve_with_a_server() -> tuple[subprocess.Popen, psutil.Process, list[psutil.Process]]:
    """The SERVE stand-in in a session of its own, its server and the server's family (the server and its child)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    assert serve.stdout is not None
    server = psutil.Process(int(serve.stdout.readline()))
    deadline = time.time() + 10
    while not server.children() and time.time() < deadline:
        time.sleep(0.05)
    return serve, server, [server, *server.children(recursive=True)]


def test_a_serve_killed_with_its_whole_process_group_takes_its_servers_and_their_children_with_it():
    import signal

    serve, server, family = _serve_with_a_server()
    try:
        assert len(family) == 2 and os.getpgid(family[1].pid) == server.pid  # the child is in the server's group
        _watcher(serve)
        os.killpg(serve.pid, signal.SIGKILL)  # kill -KILL -- -<serve's group>: serve and whatever else is in it
        serve.wait()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, alive
    finally:
        serve.kill()
        for p in [*family, *psutil.Process().children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_a_server_dies_with_serve_at_once_even_when_its_watcher_is_gone():
    import signal

    serve, server, family = _serve_with_a_server()
    try:
        watcher = _watcher(serve)
        watcher.kill()  # the watcher gone first (killed by hand, or by the OOM killer)
        watcher.wait(10)
        serve.kill()
        serve.wait()
        # The parent-death signal: the server itself (what it started is the watcher's to kill).
        server.wait(5)
    finally:
        serve.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        for p in [*family, *psutil.Process().children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _watchers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if any(arg.endswith("orphans.py") for arg in p.cmdline())]


def test_children_stopped_take_their_watchers_at_once():
    from batch_dagster.serve.processes import Children

    children = Children()
    children.start("server", ["sh", "-c", "sleep 120 & wait"], env={"PATH": "/usr/bin:/bin"})
    try:
        assert len(_watchers()) == 1
    finally:
        children.stop(grace_s=5)
    # Gone when stop returns, not up to a poll later: a `make serve` stopped with Ctrl-C leaves no process behind.
    assert [p for p in _watchers() if p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_released_watcher_is_gone_and_spares_what_it_watched():
    engine = subprocess.Popen(["sleep", "120"])
    try:
        watcher = orphans.watch([engine.pid])
        assert watcher is not None and len(_watchers()) == 1
        orphans.release(watcher)
        assert watcher.poll() is not None and _watchers() == []
        assert engine.poll() is None
    finally:
        engine.kill()
        engine.wait()
