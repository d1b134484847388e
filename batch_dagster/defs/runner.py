"""Running one batch through Dagster from Python: register its partition, materialize its lifecycle, report.

`batch-dagster run` and the demo use it. The run is recorded in the project's Dagster instance and
the batch in the metadata store, so the UI and the API show it afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

from batch_dagster.batchfile.contract import PIPELINE_ERROR, BatchError
from batch_dagster.batchfile.failure import keep_finished
from batch_dagster.batchfile.folder import ERRORS, OUTPUT, BatchFolder, Progress
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.batchfile.outcome import BatchOutcome, RunOutcome
from batch_dagster.features.eta import RunningEta
from batch_dagster.settings import Settings
from batch_dagster.terminal import output_to_log


class ProgressBar(threading.Thread):
    """A progress bar over the batch's finished requests, read from its folder while the run goes on."""

    def __init__(self, folder: BatchFolder, enabled: bool, stream: TextIO | None = None):
        super().__init__(daemon=True)
        self.folder, self.enabled, self.stream = folder, enabled, stream
        self.stop = threading.Event()

    def run(self) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar, shown, eta = None, None, RunningEta(0.0, 0.0)
        while True:
            stopping = self.stop.wait(0.5)  # once more after the stop, so the bar ends on the final counts
            manifest = self.folder.manifest()
            if manifest is not None:
                if bar is None:
                    bar = tqdm(total=manifest.total_requests, unit="req", desc="requests",
                               file=self.stream or sys.stderr)
                    eta = RunningEta.of(self.folder.estimate(), manifest.total_requests)
                # The progress document: the committed shards' totals and the live shard's count, in one read.
                progress = self.folder.progress() or Progress()
                counts = progress.request_counts
                done = counts.completed + counts.failed + (progress.done if progress.shard is not None else 0)
                failed, committed = counts.failed, progress.shards_committed
                state = (done, failed, committed)
                if state != shown:  # redraw only on change: a log file gets one line per step, not per tick
                    shown = state
                    bar.set_postfix(failed=failed, shards=f"{committed}/{manifest.shard_count}",
                                    eta=clock(eta, done),
                                    refresh=False)
                    bar.update(done - bar.n)
            if stopping:
                break
        if bar is not None:
            bar.close()


def clock(eta: RunningEta, done: int) -> str:
    """The bar's estimated end once `done` requests have finished, as the clock will show it ("?": nothing to say
    yet): the arithmetic of the API's estimated_completion_at (features/eta.py)."""
    now = time.time()
    left = eta.remaining_s(done, now)
    return "?" if left is None else time.strftime("%H:%M:%S", time.localtime(now + left))


def resource(defs: Any, key: str, instance: Any) -> Any:
    """The resource `key` of `defs` as a run on `instance` resolves it: a field a set variable fills is a dg.EnvVar
    (the UI shows its name) until then. Initialized with that instance: without one, Dagster makes an ephemeral
    instance for each resource (a tenth of a second of CPU)."""
    import dagster as dg

    with dg.build_resources({key: defs.resources[key]}, instance=instance) as built:  # none has a teardown
        return getattr(built, key)


class CliBatch:
    """The batch in the metadata store, when the definitions have one: the one record of batches (the daily
    usage report reads it), listed under the owner of dropped files' batches."""

    def __init__(self, defs: Any, input_path: Path, instance: Any):
        from batch_dagster.db import repo
        from batch_dagster.db.batches import head_model, register_local, scan, source_of
        from batch_dagster.defs.run_tags import OwnerLabels

        database = resource(defs, "database", instance) if "database" in defs.resources else None
        self.database = database if database is not None and database.url else None  # an empty url: no store
        self.storage = resource(defs, "storage", instance).open()
        # A command-line batch belongs to the drop folders' owner, else (keys and none named) the keyless one.
        self.owner = (self.database.intake_owner() if self.database is not None else "") or repo.ANONYMOUS
        self.labels = self.database.labels() if self.database is not None else OwnerLabels()
        self.model: str | None  # the model of its first request, as the batch record holds it
        if self.database is None:  # no store: the batch folder alone, whose owner is not known
            self.batch_id = repo.new_batch_id()
            self.model = head_model(scan(input_path)[0])
            folder = BatchFolder(self.storage, self.batch_id)
            folder.put_input(input_path)
            folder.declare(BatchRequest(model=self.model, metadata=source_of(input_path)))
            return
        with self.database.session() as session:
            row = register_local(session, self.storage, input_path, owner=self.owner)
            self.batch_id, self.model = row.id, row.model

    def sync(self, run_failure: str | None) -> None:
        from batch_dagster.db import repo
        from batch_dagster.db.lifecycle import sync_batch

        if self.database is not None:
            with self.database.session() as session:
                batch = repo.get_batch(session, self.owner, self.batch_id)
                if batch is None:
                    raise RuntimeError(f"Batch {self.batch_id} is no longer in the API store.")
                sync_batch(session, self.storage, batch, run_failure=run_failure)


def _failure_message(result: Any) -> str:
    for event in result.all_events:
        if event.is_failure and event.step_failure_data is not None:
            return event.step_failure_data.error.message.strip() if event.step_failure_data.error else "step failed"
    return "The run failed."


def run_batch(
    input_path: Path, out_dir: Path, *, show_progress: bool = True, defs: Any = None, instance: Any = None,
    log_dir: Path | None = None, settings: Settings | None = None,
) -> RunOutcome:
    """Register a batch partition, materialize its lifecycle through Dagster, copy the files to out_dir.

    `defs` and `instance` default to the project's definitions and instance (DAGSTER_HOME, prepared from `settings`,
    which it then needs). With
    `log_dir`, everything the run, vLLM and torch print goes to `log_dir/run-<batch id>.log` (named in
    the summary as `log_file`), the engine is shut down before returning, and only the progress bar
    reaches the terminal.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from batch_dagster.defs.dagster_internals import interruptible

    interruptible()  # a run started in the background must still stop its steps' helper processes
    # vLLM logs to stdout by default; stdout belongs to the results (--json).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import dagster as dg

    from batch_dagster.defs.cli_runs import CLI_PROCESS_TAG, fail_runs_of_gone_cli_processes, process_label
    from batch_dagster.defs.partitions import batches
    from batch_dagster.defs.run_tags import run_tags

    if defs is None:
        from batch_dagster.defs.definitions import defs as project_defs

        defs = project_defs()
    if instance is None:
        from batch_dagster.defs.instance import ensure_dagster_home

        if settings is None:
            raise ValueError("run_batch prepares the project's Dagster instance from the settings: pass them")
        ensure_dagster_home(settings)
        instance = dg.DagsterInstance.get()

    for run_id in fail_runs_of_gone_cli_processes(instance):
        print(f"batch-dagster: run {run_id} was left STARTED by a killed `batch-dagster run`: marked failed",
              file=sys.stderr)
    started = time.perf_counter()
    record = CliBatch(defs, input_path, instance)
    batch_id = record.batch_id
    folder = BatchFolder(record.storage, batch_id)
    instance.add_dynamic_partitions(batches.name, [batch_id])
    # This run starts at once, without the run queue. Tagged as the sensors tag theirs, it counts against the
    # queue's limits while it runs: an offline engine here makes the daemon's offline runs wait.
    tags = run_tags(batch_id, way_in="cli", filename=input_path.name, owner=record.owner, model=record.model,
                    vllm=resource(defs, "vllm", instance), labels=record.labels)
    tags[CLI_PROCESS_TAG] = process_label(os.getpid()) or ""
    log_file = log_dir / f"run-{batch_id}.log" if log_dir is not None else None
    with ExitStack() as stack:
        terminal = stack.enter_context(output_to_log(log_file)) if log_file is not None else None
        progress = ProgressBar(folder, show_progress, terminal)
        progress.start()
        try:
            result = defs.resolve_job_def("batch_job").execute_in_process(
                partition_key=batch_id,
                instance=instance,
                raise_on_error=False,
                # With a log file, the console logger writes there (its step failures with tracebacks too).
                run_config={"loggers": {"console": {"config": {"log_level": "DEBUG" if log_file else "WARNING"}}}},
                tags=tags,
            )
        finally:
            progress.stop.set()
            progress.join()
            if log_file is not None:
                # The engine's shutdown notices belong in the log too, not on the terminal at exit.
                from batch_dagster.engine.offline import shutdown_all

                shutdown_all()
    failure = None if result.success else _failure_message(result)
    if failure is not None:  # as the daemon ends a run that failed for good: what it finished is kept
        keep_finished(folder, failure, resource(defs, "pipeline", instance).prices())
    record.sync(failure)
    out_dir.mkdir(parents=True, exist_ok=True)
    output_file, error_file = out_dir / OUTPUT, out_dir / ERRORS
    done = folder.summary()
    if done is not None:
        for key, dest in ((folder.output_key, output_file), (folder.error_key, error_file)):
            with folder.storage.open(key) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        outcome = BatchOutcome.of(done)
    else:
        output_file.write_bytes(b"")
        error_file.write_bytes(b"")
        validation = folder.validation()
        errors = (validation.errors if validation else None) or [BatchError(PIPELINE_ERROR, _failure_message(result))]
        outcome = BatchOutcome.failed(batch_id, validation, errors)
    return RunOutcome(outcome, run_id=result.run_id, output_file=str(output_file), error_file=str(error_file),
                      duration_s=round(time.perf_counter() - started, 3),
                      log_file=str(log_file) if log_file is not None else None)
