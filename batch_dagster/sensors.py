"""Sensors that connect the HTTP API to the pipeline: launch the batches it accepts, follow their runs."""

from __future__ import annotations

import dagster as dg

from batch_dagster.jobs import batch_job
from batch_dagster.partitions import batches
from batch_dagster.resources import BatchStorage
from batch_dagster.store import TERMINAL, repo
from batch_dagster.store.lifecycle import sync_batch
from batch_dagster.store.resource import ApiStore

PARTITION_TAG = "dagster/partition"
FAILURE_REASON_TAG = "dagster/failure_reason"
# A batch marked launched with no run after this long (the tick's runs were lost) is requested again;
# the run key keeps Dagster from running it twice.
RELAUNCH_AFTER_S = 120
# A run that was interrupted rather than failed (serve stopped, its worker died) is run again, up to
# this many runs in all: the assets skip committed shards, so the new run resumes the batch.
MAX_RUNS = 3
INTERRUPTED = ("UNEXPECTED_TERMINATION", "RUN_WORKER_RESTART", "START_TIMEOUT")
_ENDED_BADLY = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def _runs_filter(batch_id: str) -> dg.RunsFilter:
    return dg.RunsFilter(job_name=batch_job.name, tags={PARTITION_TAG: batch_id})


def run_key(instance: dg.DagsterInstance, batch_id: str) -> str:
    """The batch id for its first run; `<batch id>:<n>` for the n-th, when an interrupted run is resumed."""
    runs = instance.get_runs_count(_runs_filter(batch_id))
    return batch_id if runs == 0 else f"{batch_id}:{runs + 1}"


@dg.sensor(
    job=batch_job,
    minimum_interval_seconds=3,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds each batch created through the API as a partition and runs batch_job for it.",
)
def api_batch_sensor(context: dg.SensorEvaluationContext, api_store: ApiStore) -> dg.SensorResult | dg.SkipReason:
    with api_store.session() as session:
        waiting = [b.id for b in repo.batches_to_launch(session)]
        if not waiting:
            return dg.SkipReason("No new batches.")
        repo.mark_launched(session, waiting)
    context.log.info(f"Launching {len(waiting)} batch(es): {', '.join(waiting)}")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(partition_key=batch_id, run_key=run_key(context.instance, batch_id),
                          tags={"batch_id": batch_id, "source": "api"})
            for batch_id in waiting
        ],
        dynamic_partitions_requests=[batches.build_add_request(waiting)],
    )


def latest_run(instance: dg.DagsterInstance, batch_id: str) -> dg.DagsterRun | None:
    records = instance.get_run_records(_runs_filter(batch_id), limit=1)
    return records[0].dagster_run if records else None


def run_failure_message(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    """The first step failure of a run, or its run-level message."""
    for record in instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records:
        event = record.event_log_entry.dagster_event
        error = event.step_failure_data.error if event and event.step_failure_data else None
        if error is not None:
            while error.cause is not None:  # the step error wraps what the code raised
                error = error.cause
            return f"The pipeline failed in step {event.step_key}: {error.message.strip()} (Dagster run {run.run_id})"
    verb = "was canceled" if run.status == dg.DagsterRunStatus.CANCELED else "failed"
    return f"The pipeline run {verb} (Dagster run {run.run_id}); see the Dagster UI."


@dg.sensor(
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Brings the API's batches up to date with their runs: progress, the end, runs that failed.",
)
def api_batch_status_sensor(
    context: dg.SensorEvaluationContext, api_store: ApiStore, storage: BatchStorage
) -> dg.SkipReason:
    instance = context.instance
    moved = 0
    with api_store.session() as session:
        for batch in repo.active_batches(session):
            before = batch.status
            run = latest_run(instance, batch.id)
            if run is None:
                if repo.now() - batch.launched_at > RELAUNCH_AFTER_S:
                    context.log.warning(f"{batch.id}: no run since it was launched; requesting it again")
                    repo.unmark_launched(session, batch.id)
                continue
            if batch.run_id != run.run_id:
                batch.run_id = run.run_id
                session.commit()
            sync_batch(session, storage, batch)
            ended_badly = run.status in _ENDED_BADLY and not run.is_complete_and_waiting_to_retry
            if ended_badly and batch.status not in TERMINAL:
                if run.tags.get(FAILURE_REASON_TAG) in INTERRUPTED and instance.get_runs_count(
                    _runs_filter(batch.id)
                ) < MAX_RUNS:
                    context.log.warning(f"{batch.id}: run {run.run_id} was interrupted; resuming in a new run")
                    repo.unmark_launched(session, batch.id)
                    continue
                sync_batch(session, storage, batch, run_failure=run_failure_message(instance, run))
            if batch.status != before:
                moved += 1
                context.log.info(f"{batch.id}: {before} -> {batch.status}")
        for file in repo.expired_files(session):
            repo.delete_file(session, file)
    return dg.SkipReason(f"{moved} batch(es) changed status.")
