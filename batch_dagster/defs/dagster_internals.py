"""Workarounds that lean on Dagster internals or on the text of its messages, kept in one marked place.

Each was written against Dagster 1.13 (1.13.27) and says what it relies on; re-check them when
upgrading Dagster. The rest of the project uses Dagster's public API only.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

WRITTEN_FOR = "1.13.27"
RUN_WATCH_S = 2.0
# Dagster 1.13: the RUN_FAILURE message when something outside the run (the code server) saw its process die.
MARKED_FROM_OUTSIDE = "marked as failed from outside the execution context"
# Dagster 1.13: the tag where the default run launcher records the code server that started the run worker.
GRPC_INFO_TAG = ".dagster/grpc_info"
_LAUNCHED = (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)


@contextmanager
def dies_with_its_run(context: dg.AssetExecutionContext) -> Iterator[None]:
    """Within this block, the process is killed if its run is marked finished (failed) meanwhile.

    batch_job runs its steps in the run worker itself, which dies whole. With a process per step (an
    executor other than batch_job's), Dagster 1.13 has no public way for a step to learn that its run
    worker died: killed, the worker leaves its step process on as an orphan, inferring and committing
    shards, while the run retry starts a new run (and a second engine) on the same shards. The code
    server marks the dead worker's run failed within a second; this watchdog then kills the orphan too.
    """
    stop = threading.Event()
    instance, run_id = context.instance, context.run.run_id

    def watch() -> None:
        while not stop.wait(RUN_WATCH_S):
            run = instance.get_run_by_id(run_id)
            if run is not None and run.is_finished:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="run-watch").start()
    try:
        yield
    finally:
        stop.set()


def run_end_reason(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """The run failure's message; when the code server marked the run failed, the crash it logged just before.

    Relies on the text of Dagster 1.13's RUN_FAILURE message (MARKED_FROM_OUTSIDE).
    """
    kinds = {dg.DagsterEventType.RUN_FAILURE, dg.DagsterEventType.ENGINE_EVENT}
    events = [r.event_log_entry.dagster_event for r in instance.get_records_for_run(run.run_id, of_type=kinds).records]
    ends = [
        i for i, event in enumerate(events)
        if event is not None and event.event_type == dg.DagsterEventType.RUN_FAILURE
    ]
    if not ends:
        return None
    end = events[ends[-1]]
    message = (end.message if end else None) or ""
    before = events[ends[-1] - 1] if ends[-1] > 0 else None
    if MARKED_FROM_OUTSIDE in message and before is not None:
        message = before.message or message
    return message.strip() or None


def worker_gone(run: dg.DagsterRun) -> bool:
    """Whether an unfinished run's code server refuses connections: serve was stopped or killed mid-run.

    The code server is the run worker's parent and outlives it while it runs, and it is what marks a
    dead worker's run failed. When it is gone too, nothing else ever would. Uses Dagster 1.13's
    private `DagsterGrpcClient` and the GRPC_INFO_TAG the default run launcher writes.
    """
    info = run.tags.get(GRPC_INFO_TAG)
    if run.status not in _LAUNCHED or not info:
        return False
    import grpc
    from dagster._core.errors import DagsterUserCodeUnreachableError
    from dagster._grpc.client import DagsterGrpcClient

    where = json.loads(info)
    client = DagsterGrpcClient(port=where.get("port"), socket=where.get("socket"),
                               host=where.get("host") or "localhost")
    try:
        client.ping("")
    except DagsterUserCodeUnreachableError as exc:  # a busy server times out instead: that is not gone
        cause = exc.__cause__
        return isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE
    return False
