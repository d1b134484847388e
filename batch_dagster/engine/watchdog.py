"""An in-process engine whose core process dies fails its call within seconds, instead of hanging it.

vLLM's synchronous client (`vllm.LLM`, V1 engine with its core in a child process) notices a dead core
(its `MPClientEngineMonitor` thread) and shuts itself down, but tells nobody: a `generate` in flight
waits forever on the client's output queue (vLLM 0.32). A crashed model worker is different, the core
reports it. `watch` starts a thread that polls the core processes and, when one dies, puts vLLM's own
`EngineDeadError` into that queue, so the call raises as it does for a crashed worker. It also kills what
the dead core leaves behind (its model workers), which would otherwise hold their memory.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5


def watch(pids: list[int], client: Any) -> threading.Event | None:
    """Watch the engine core processes `pids` of `client` (the LLM's engine-core client).

    Returns an event that stops the watch (set it before stopping the engine on purpose), or None when
    the client has no core process of its own to watch (vLLM without multiprocessing).
    """
    import psutil

    # vLLM internals, for 0.32 (SyncMPClient): the queue `get_output` waits on.
    outputs = getattr(client, "outputs_queue", None)
    if outputs is None or not pids:
        return None
    cores, family = [], []
    for pid in pids:
        try:
            core = psutil.Process(pid)
            cores.append(core)
            family += [core, *core.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    stop = threading.Event()

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def run() -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        while not stop.wait(POLL_S):
            dead = [p.pid for p in cores if not alive(p)]
            if dead:
                break
        else:
            return
        log.error("The vLLM engine core process %s died: failing the engine's call", dead)
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        outputs.put_nowait(EngineDeadError(f"The engine core process {dead[0]} died."))

    threading.Thread(target=run, daemon=True, name="engine-core-watchdog").start()
    return stop
