"""Sensors that connect the HTTP API to the pipeline: launch the batches it accepts, follow their runs."""

from __future__ import annotations

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.batchfile.failure import keep_finished
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import BatchRecord, repo
from batch_dagster.db.eta import set_launch_priorities
from batch_dagster.db.labels import OWNER_TAG, input_filenames, run_tags
from batch_dagster.db.lifecycle import sync_batch
from batch_dagster.defs.dagster_internals import run_end_reason, worker_gone
from batch_dagster.defs.jobs import batch_job
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource, VLLMResource
from batch_dagster.defs.run_limits import PRIORITY_TAG
from batch_dagster.defs.runner import CLI_GONE, cli_process_gone
from batch_dagster.defs.sensors.fairness import with_fair_priorities

PARTITION_TAG = "dagster/partition"
RETRY_NUMBER_TAG = "dagster/retry_number"
WILL_RETRY_TAG = "dagster/will_retry"
# A batch marked launched with no run after this long (the tick's runs were lost) is requested again;
# the run key keeps Dagster from running it twice.
RELAUNCH_AFTER_S = 120
# Dagster tags a failed run `will_retry` just after it marks it failed; until then (at most this long)
# the sensor waits rather than failing a batch that run retries are about to resume.
RETRY_DECISION_WAIT_S = 60
MAX_FAILURE_CHARS = 1000  # of a step's error message, as a failed batch's errors.data shows it
_ENDED_BADLY = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
WORKER_GONE = ("The run's worker is gone with the code server that started it "
               "(serve was stopped or killed while it ran).")


def _gone(run: dg.DagsterRun) -> str | None:
    """Why an unfinished run's process is gone with nothing left to mark it failed, if it is."""
    if worker_gone(run):
        return WORKER_GONE
    if cli_process_gone(run):
        return CLI_GONE
    return None


def _runs_filter(batch_id: str) -> dg.RunsFilter:
    return dg.RunsFilter(job_name=batch_job.name, tags={PARTITION_TAG: batch_id})


def run_key(instance: dg.DagsterInstance, batch_id: str) -> str:
    """The batch id for its first run; `<batch id>:<n>` when the batch already has n-1 runs (relaunched)."""
    runs = instance.get_runs_count(_runs_filter(batch_id))
    return batch_id if runs == 0 else f"{batch_id}:{runs + 1}"


@dg.sensor(
    job=batch_job,
    minimum_interval_seconds=3,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds each batch created through the API as a partition and runs batch_job for it.",
)
def api_batch_sensor(context: dg.SensorEvaluationContext, database: DatabaseResource,
                     vllm: VLLMResource) -> dg.SensorResult | dg.SkipReason:
    with database.session() as session:
        rows = repo.batches_to_launch(session)
        if not rows:
            return dg.SkipReason("No new batches.")
        waiting = [b.id for b in rows]
        repo.mark_launched(session, waiting)
        # The run waits in the run queue by the model its batch recorded at creation.
        filenames = input_filenames(session, rows)
        labels = database.labels()
        tags = [run_tags(b.id, source="api", filename=filenames.get(b.id), owner=b.owner, model=b.model,
                         vllm=vllm, labels=labels) for b in rows]
        priorities = [b.priority for b in rows]
    # Higher priority first; among equals, oldest first and owners interleaved: the run queue launches by these.
    tags = with_fair_priorities(context.instance, batch_job.name, tags, OWNER_TAG, priorities)
    with database.session() as session:  # each batch's place in the launch order, for its queue_position
        set_launch_priorities(session, {b: int(t[PRIORITY_TAG]) for b, t in zip(waiting, tags, strict=True)})
    context.log.info(f"Launching {len(waiting)} batch(es): {', '.join(waiting)}")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(partition_key=batch_id, run_key=run_key(context.instance, batch_id), tags=t)
            for batch_id, t in zip(waiting, tags, strict=True)
        ],
        dynamic_partitions_requests=[batches.build_add_request(waiting)],
    )


def latest_run(instance: dg.DagsterInstance, batch_id: str) -> dg.DagsterRun | None:
    records = instance.get_run_records(_runs_filter(batch_id), limit=1)
    return records[0].dagster_run if records else None


def run_failure_message(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    """The first step failure of a run, else how the run ended (e.g. its process was killed)."""
    retries = run.tags.get(RETRY_NUMBER_TAG)
    where = f"Dagster run {run.run_id}" + (f", retry {retries}" if retries else "")
    for record in instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records:
        event = record.event_log_entry.dagster_event
        if event is None or event.step_failure_data is None:
            continue
        error = event.step_failure_data.error
        if error is not None:
            while error.cause is not None:  # the step error wraps what the code raised
                error = error.cause
            # Cut: the message may quote anything, and the batch object lists it.
            message = error.message.strip()[:MAX_FAILURE_CHARS]
            return f"The pipeline failed in step {event.step_key}: {message} ({where})"
    verb = "was canceled" if run.status == dg.DagsterRunStatus.CANCELED else "failed"
    reason = run_end_reason(instance, run)
    return f"The pipeline run {verb} ({where})" + (f": {reason}" if reason else "; see the Dagster UI.")


def _retry_pending(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether Dagster's run retries (dagster.yaml `run_retries`) will still run this failed run again."""
    if run.is_complete_and_waiting_to_retry:
        return True
    if run.status != dg.DagsterRunStatus.FAILURE or not instance.run_retries_enabled or WILL_RETRY_TAG in run.tags:
        return False
    record = instance.get_run_record_by_id(run.run_id)
    ended = record.end_time if record and record.end_time else None
    return ended is None or repo.now() - ended < RETRY_DECISION_WAIT_S


def _follow(context: dg.SensorEvaluationContext, session: Session, folders: Storage, batch: BatchRecord,
            followed: set[str], pipeline: PipelineConfig) -> None:
    """Bring one batch up to date with its latest run (each change committed by itself: its own transaction)."""
    instance = context.instance
    run = latest_run(instance, batch.id)
    if run is None:
        # active_batches() returns launched batches only: launched_at is set (the check narrows its type).
        if batch.launched_at is not None and repo.now() - batch.launched_at > RELAUNCH_AFTER_S:
            context.log.warning(f"{batch.id}: no run since it was launched; requesting it again")
            repo.unmark_launched(session, batch.id)
        return
    followed.add(run.run_id)
    if batch.run_id != run.run_id:
        batch.run_id = run.run_id
        session.commit()
    sync_batch(session, folders, batch)
    if batch.status not in TERMINAL and (gone := _gone(run)):
        context.log.warning(f"{batch.id}: run {run.run_id}: {gone} Marking it failed")
        instance.report_run_failed(run, gone)
        return  # next tick: Dagster retries it (dagster.yaml run_retries), or the batch fails
    if run.status in _ENDED_BADLY and batch.status not in TERMINAL:
        # A retried run is a new run of the same partition: the next tick follows that one.
        if _retry_pending(instance, run):
            context.log.info(f"{batch.id}: run {run.run_id} failed; Dagster will retry it")
            return
        failure = run_failure_message(instance, run)
        try:
            keep_finished(BatchFolder(folders, batch.id), failure, pipeline.prices())  # read when one is needed
        except Exception as exc:  # the store unreachable: the batch still ends, without its files
            context.log.error(f"{batch.id}: could not keep what its run finished ({str(exc)[:500]})")
        sync_batch(session, folders, batch, run_failure=failure)


@dg.sensor(
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Brings the API's batches up to date with their runs: progress, the end, and runs that failed "
    "for good (after Dagster's run retries; the batch keeps the shards they finished) or whose process is gone "
    "with serve.",
)
def api_batch_status_sensor(
    context: dg.SensorEvaluationContext, database: DatabaseResource, storage: StorageResource,
    pipeline: PipelineConfig,
) -> dg.SkipReason:
    instance, folders = context.instance, storage.storage()
    moved, followed = 0, set[str]()
    with database.session() as session:
        for batch in repo.active_batches(session):
            batch_id, before = batch.id, batch.status
            try:
                _follow(context, session, folders, batch, followed, pipeline)
            except Exception as exc:  # a value the store refuses, a damaged document: the other batches still move
                session.rollback()
                context.log.error(f"{batch_id}: could not be brought up to date ({str(exc)[:500]}); left as stored, "
                                  "tried again on the next tick")
                continue
            if batch.status != before:
                moved += 1
                context.log.info(f"{batch_id}: {before} -> {batch.status}")
    # A stopped serve leaves the runs of ended batches (backfills) STARTED too. Until marked failed they keep their
    # place in the run queue's limits (dagster.yaml), and offline runs would wait for them for ever.
    for run in instance.get_runs(dg.RunsFilter(job_name=batch_job.name, statuses=[dg.DagsterRunStatus.STARTED])):
        if run.run_id not in followed and (gone := _gone(run)):
            context.log.warning(f"Run {run.run_id}: {gone} Marking it failed")
            instance.report_run_failed(run, gone)
    return dg.SkipReason(f"{moved} batch(es) changed status.")
