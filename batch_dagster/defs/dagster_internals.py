"""Workarounds that lean on Dagster internals or on the text of its messages, kept in one marked place.

Each was written against Dagster 1.13 (1.13.27) and says what it relies on; re-check them when
upgrading Dagster. The rest of the project uses Dagster's public API only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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

    The code server started the run worker (through its forkserver under serve: run_code_server) and outlives it
    while it runs, and it is what marks a dead worker's run failed. When it is gone too, nothing else ever would.
    Uses Dagster 1.13's private `DagsterGrpcClient` and the GRPC_INFO_TAG the default run launcher writes.
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


def delete_run_leftovers(instance: dg.DagsterInstance, run_id: str) -> None:
    """What `instance.delete_run` leaves of a deleted run in Dagster 1.13: its asset check executions (a table
    keyed by run id that delete_events does not touch) and, on SQLite event-log storage, the run's own database
    file `<run_id>.db` (emptied, not removed). Uses the private table definition and storage classes."""
    from dagster._core.storage.event_log.schema import AssetCheckExecutionsTable
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
    from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage

    storage = instance.event_log_storage
    if isinstance(storage, SqlEventLogStorage) and storage.has_table(AssetCheckExecutionsTable.name):
        with storage.index_connection() as conn:
            conn.execute(AssetCheckExecutionsTable.delete().where(AssetCheckExecutionsTable.c.run_id == run_id))
    if isinstance(storage, SqliteEventLogStorage):
        shard = storage.path_for_shard(run_id)
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shard + suffix)


def forget_partition_status(instance: dg.DagsterInstance, asset_keys: list[dg.AssetKey]) -> None:
    """Drop the assets' cached partition status, which keeps the keys of deleted partitions: the next read rebuilds
    it from the materializations that remain. `wipe_asset_cached_status` is not public in Dagster 1.13."""
    instance.wipe_asset_cached_status(asset_keys)


def staged_logs(instance: dg.DagsterInstance) -> tuple[Any, Path] | None:
    """The local manager and folder where a cloud compute log manager (dagster-aws's S3ComputeLogManager) stages
    step logs before uploading them, or None when the logs are kept locally (those are the logs themselves).

    A step's staged files are removed once uploaded; a process killed mid-step leaves them. Relies on Dagster 1.13's
    private LocalComputeLogManager class and on its file layout (`<folder>/<run_id>/compute_logs/...`).
    """
    from dagster._core.storage.local_compute_log_manager import LocalComputeLogManager

    manager = instance.compute_log_manager
    local = getattr(manager, "local_manager", None)
    if isinstance(manager, LocalComputeLogManager) or not isinstance(local, LocalComputeLogManager):
        return None
    return local, Path(local.get_captured_local_path(["probe"], "out")).parent


def interruptible() -> None:
    """Undo a background job's ignored SIGINT (`nohup batch-dagster run FILE &`) before a run executes here.

    Dagster 1.13 maps SIGTERM to SIGINT's handler when it executes a job (dagster._utils.interrupts
    setup_interrupt_handlers), so SIGTERM would be ignored too, and the compute-log `tail` processes it starts for
    each step inherit that: they ignore terminate(), and each step waits 30 s for them (compute_logs.py).
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Dagster 1.13's daemon lines that say a loop went round, not that anything happened, by the logger that writes them
# (dagster._daemon.daemon.get_default_daemon_logger: one per daemon) and how they begin. Under serve the sensor daemon
# loops every second: at info they were two or three lines a second, thousands an hour.
TICK_LINES = {
    "dagster.daemon.SensorDaemon": re.compile(
        r"Checking for new runs for sensor: |Sensor \S+ skipped: |No run requests returned for \S+, skipping"),
    # Every second while a run waits in the queue.
    "dagster.daemon.QueuedRunCoordinatorDaemon": re.compile(r"Priority sorting and checking tag concurrency limits"),
    # Every run monitoring loop while runs go on.
    "dagster.daemon.MonitoringDaemon": re.compile(r"Collected \d+ runs for monitoring|Checking run \S+$"),
}


class _TickAtDebug(logging.Filter):
    """Lowers an info line that only says a loop went round to debug; the daemon's handler (at
    DAGSTER_DAEMON_LOG_LEVEL, info by default) then leaves it out, and `--log-level debug` shows it again."""

    def __init__(self, lines: re.Pattern[str]) -> None:
        super().__init__()
        self.lines = lines

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and self.lines.match(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def ticks_at_debug() -> None:
    """Log the daemon's loops (a sensor evaluated and skipped, the run queue or run monitoring looked) at debug, and
    leave what happens at info: a run requested and launched, a run marked failed, a tick that failed (at error).

    Dagster 1.13 writes both at info on the same loggers, with no setting between them (`dagster-daemon run
    --log-level` sets every daemon logger at once). Relies on the loggers' names and the lines' text (TICK_LINES).
    Our sensors log what they did on their own, at info, through their context's log.
    """
    for name, lines in TICK_LINES.items():
        logging.getLogger(name).addFilter(_TickAtDebug(lines))


def run_daemon(argv: list[str], sensor_loop_s: float, launch_nudge: str | None = None,
               launch_sensor: str | None = None) -> None:
    """`dagster-daemon <argv>` in this process (it exits with the command), its sensor daemon looking for due sensors
    every `sensor_loop_s`, its loops logged at debug (ticks_at_debug), its code servers started as
    `python -m batch_dagster.defs.code_server` (warm run workers: run_code_server), and, given `launch_nudge`, the
    sensor `launch_sensor` ticked as soon as the API says it created a batch (`nudged`).

    Dagster 1.13's sensor daemon evaluates the sensors whose minimum interval has passed once per loop, and its loop
    runs every 5 s at most, a module constant with no setting (dagster._daemon.sensor.MIN_INTERVAL_LOOP_TIME): a
    batch created through the API would wait up to 5 s for its launch, and as long again for its end to show. Uses
    that private constant, the private entry point of the `dagster-daemon` command (dagster._daemon.cli.main) and
    the private function that names the command a managed code server is started with
    (dagster._grpc.server.get_python_environment_entry_point, `python -m dagster`).
    """
    from dagster._daemon import sensor
    from dagster._daemon.cli import main
    from dagster._grpc import server

    sensor.MIN_INTERVAL_LOOP_TIME = sensor_loop_s  # type: ignore[assignment]  # an int there; only waited on
    server.get_python_environment_entry_point = code_server_command
    if launch_nudge and launch_sensor:
        nudged(launch_nudge, launch_sensor)
    ticks_at_debug()
    sys.argv = ["dagster-daemon", *argv]
    main()


class Nudges:
    """What the daemon has been told: when a batch was last created, when the launch sensor's last tick began, and the
    events its two loops wake on."""

    PENDING_S = 5.0  # the longest a nudge keeps the sensor loop's waits short (a stopped launch sensor serves none)
    POLL_S = 0.05  # the sensor loop's wait while a nudge is pending

    def __init__(self) -> None:
        self.created_at = 0.0  # unix seconds, as Dagster's tick timestamps
        self.ticked_at = 0.0  # when the launch sensor's last tick began, as its state last read said
        self.sensors = threading.Event()  # the sensor daemon's loop
        self.queue = threading.Event()  # the run queue's loop: a run was queued

    def created(self) -> None:
        self.created_at = time.time()
        self.sensors.set()

    def pending(self) -> bool:
        """Whether a batch was created after the launch sensor's last tick began (and lately): the tick that will
        launch it has not begun. Dagster keeps one tick per sensor in flight: a nudge during one waits for its end."""
        return self.created_at > max(self.ticked_at, time.time() - self.PENDING_S)


class _WokenShutdown:
    """The sensor daemon's shutdown event as its loop sees it: the loop's wait between passes also ends at a nudge,
    and is short while a nudge is pending (a tick of the launch sensor begun before it still in flight). Dagster
    1.13's sensor loop (execute_sensor_iteration_loop) only waits on it; the daemon's own loop checks the real event,
    so a stop is seen as before (its waits are at most the loop time, 0.5 s)."""

    def __init__(self, shutdown: threading.Event, nudges: Nudges) -> None:
        self.shutdown, self.nudges = shutdown, nudges

    def is_set(self) -> bool:
        return self.shutdown.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if self.nudges.pending():
            timeout = self.nudges.POLL_S if timeout is None else min(timeout, self.nudges.POLL_S)
        if self.nudges.sensors.wait(timeout):
            self.nudges.sensors.clear()
        return self.shutdown.is_set()


def nudged(path: str, launch_sensor: str) -> Nudges:
    """Tick `launch_sensor` as soon as a datagram arrives on the Unix socket `path` (the API sends one per batch it
    creates, api/launch_nudge.py), and dequeue the run it queues at once, rather than at each loop's next pass: up to
    1.5 s for the sensor (its 1 s minimum interval, looked at every 0.5 s) and 1 s for the run queue
    (`dequeue_interval_seconds` takes whole seconds), most of a small batch's fixed cost (issue #46). A nudge that
    comes while the launch sensor's tick is in flight (Dagster keeps one per sensor) has the loop look again every
    POLL_S until the next tick begins, not at its next pass. Every other tick and dequeue happens as before, and
    nothing waits on a nudge: one lost changes nothing but the wait.

    Relies on Dagster 1.13's module-level `dagster._daemon.sensor.is_under_min_interval` (called before a sensor's
    tick is submitted, and again as it starts) and `get_elapsed`, `SensorDaemon.core_loop` handing its shutdown event
    to the sensor loop, which only waits on it, `QueuedRunCoordinator.submit_run` (the run queued by the sensor's
    tick, in this process) and `QueuedRunCoordinatorDaemon`'s `run_iteration` and `interval_seconds`, whose loop
    (IntervalDaemon.core_loop) is this one's but for the wake.
    """
    import socket

    from dagster._core.run_coordinator.queued_run_coordinator import QueuedRunCoordinator
    from dagster._daemon import sensor
    from dagster._daemon.daemon import SensorDaemon, SpanMarker
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
    from dagster._utils.error import serializable_error_info_from_exc_info

    nudges = Nudges()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        listener.bind(path)
    except OSError as exc:  # the daemon runs on, its sensors ticking at their own intervals
        logging.getLogger("batch_dagster.daemon").warning("No launch nudges (%s: %s)", path, exc)
        listener.close()
        return nudges
    due_by_interval = sensor.is_under_min_interval

    def is_under_min_interval(state: Any, remote_sensor: Any, minimum_allowed_min_interval: int | None = None) -> bool:
        if remote_sensor.name == launch_sensor:
            elapsed = sensor.get_elapsed(state)
            if elapsed is not None:
                nudges.ticked_at = time.time() - elapsed
                if nudges.created_at > nudges.ticked_at:
                    return False  # a batch was created after its last tick began
        return due_by_interval(state, remote_sensor, minimum_allowed_min_interval)

    sensor.is_under_min_interval = is_under_min_interval
    sensor_loop = SensorDaemon.core_loop

    def sensor_core_loop(self: Any, workspace_process_context: Any, shutdown_event: threading.Event) -> Any:
        woken = _WokenShutdown(shutdown_event, nudges)  # what of an Event the sensor loop uses
        return sensor_loop(self, workspace_process_context, woken)  # type: ignore[arg-type]

    SensorDaemon.core_loop = sensor_core_loop  # type: ignore[method-assign]
    submit_run = QueuedRunCoordinator.submit_run

    def submit_and_wake(self: Any, context: Any) -> Any:
        run = submit_run(self, context)
        nudges.queue.set()
        return run

    QueuedRunCoordinator.submit_run = submit_and_wake  # type: ignore[method-assign]

    def queue_core_loop(self: Any, workspace_process_context: Any, shutdown_event: threading.Event) -> Any:
        while True:
            start = time.time()
            yield SpanMarker.START_SPAN
            try:
                yield from self.run_iteration(workspace_process_context)
            except Exception:
                error_info = serializable_error_info_from_exc_info(sys.exc_info())
                self._logger.error("Caught error:\n%s", error_info)
                yield error_info
            yield SpanMarker.END_SPAN
            while time.time() - start < self.interval_seconds and not shutdown_event.is_set():
                if nudges.queue.wait(0.5):
                    nudges.queue.clear()
                    break
                yield None
            yield None

    QueuedRunCoordinatorDaemon.core_loop = queue_core_loop  # type: ignore[method-assign]

    def listen() -> None:
        while True:
            listener.recv(64)
            nudges.created()

    threading.Thread(target=listen, daemon=True, name="launch-nudges").start()
    return nudges


CODE_SERVER_MODULE = "batch_dagster.defs.code_server"


def code_server_command(executable_path: str) -> list[str]:
    """How the daemon starts a code server: this module's, in place of `python -m dagster`, with the same arguments."""
    return [executable_path, "-m", CODE_SERVER_MODULE]

# What a run worker's process holds before its run: Dagster and the project's definitions (their import is most of a
# new process's start), and what the batch's steps import on first use that the definitions do not: pandas (the
# validation's columns; 0.4 to 0.8 s of a small batch's validate step under load), pyarrow's datasets and httpx (the
# server engine). Then all of it is frozen (defs/gc_frozen.py).
RUN_WORKER_PRELOAD = ["dagster._grpc.impl", "batch_dagster.definitions", "pandas", "pyarrow.dataset", "httpx",
                      "batch_dagster.defs.gc_frozen"]


def run_code_server(argv: list[str]) -> None:
    """`dagster <argv>` (`api grpc ...`, a code server) in this process, whose run workers are forked from a
    forkserver that has imported RUN_WORKER_PRELOAD, started with the server, as Dagster's multiprocess executor
    starts its step processes (`start_method: forkserver`), rather than spawned as new interpreters that import
    Dagster and the project first (1.5 to 2.6 s of a small batch's run launch).

    Each run still gets a process of its own, forked from the forkserver (which runs nothing itself), that the code
    server watches and marks failed when it dies, as before. Dagster 1.13's code server spawns them from
    `multiprocessing.get_context("spawn")`, set in DagsterApiServer.__init__ with no setting (its private
    `_mp_ctx`); uses that attribute and the private entry point of the `dagster` command (dagster._cli.main).
    """
    import multiprocessing
    import multiprocessing.forkserver

    from dagster._cli import main
    from dagster._grpc.server import DagsterApiServer

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RUN_WORKER_PRELOAD)
    original = DagsterApiServer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._mp_ctx = context
        # Started now, not at the first run: that run would pay the imports.
        threading.Thread(target=multiprocessing.forkserver.ensure_running, daemon=True).start()

    DagsterApiServer.__init__ = __init__  # type: ignore[method-assign]
    sys.argv = ["dagster", *argv]
    main()
