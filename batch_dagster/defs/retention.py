"""History retention: once a batch ended BATCH_HISTORY_RETENTION_S ago, or once more than BATCH_HISTORY_MAX_BATCHES
batch partitions exist (the batches that ended first go first), its Dagster history and working files go.

Deleted: the batch's dynamic partition, every run of that partition (batch_job, deliver_results_job, backfills) with
its event log (materializations and check results included) and its step logs, and the folder's working files. Kept:
the batch's row (the API still answers for it; the daily report counts it), its summary.json (the report prices it
by it) and the files the store still serves (output and error files until they expire). So the partition count stays
near retention x rate, and under the bound whatever the rate (batches not ended keep theirs). Each pass also sweeps
leftover scratch files and staged step logs.
"""

from __future__ import annotations

import json
import re
import time

import dagster as dg

from batch_dagster.db import repo
from batch_dagster.db.lifecycle import folder_bytes
from batch_dagster.defs.assets.batch import LIFECYCLE
from batch_dagster.defs.assets.delivery import delivered_results
from batch_dagster.defs.dagster_internals import delete_run_leftovers, forget_partition_status, staged_logs
from batch_dagster.defs.partitions import BATCH_PARTITIONS
from batch_dagster.defs.resources import DatabaseResource, StorageResource
from batch_dagster.defs.resources.setting_fields import setting
from batch_dagster.defs.sensor_timing import timed
from batch_dagster.features.retention import Ended, ended_before, record_stored_bytes, served_keys
from batch_dagster.storage import scratch

PARTITION_TAG = "dagster/partition"
# Bounded work per tick, so that a year's backlog (the first pass on an old install) never runs into Dagster's
# 60 s limit on a sensor evaluation: it is worked off tick after tick.
BATCHES_PER_TICK = 200
TICK_BUDGET_S = 30.0
BATCH_ASSETS = [*LIFECYCLE, delivered_results.key]
_RUN_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class Retention(dg.ConfigurableResource):
    """Seconds after its end at which a batch's Dagster history and working files go (0: never), the most batch
    partitions kept (0: no bound), and the age past which leftover scratch files and staged step logs are swept."""

    history_retention_s: int = setting("BATCH_HISTORY_RETENTION_S")
    history_max_batches: int = setting("BATCH_HISTORY_MAX_BATCHES")
    scratch_max_age_s: int = setting("BATCH_SCRATCH_MAX_AGE_S")


def purge_history(instance: dg.DagsterInstance, batch_id: str) -> bool:
    """Delete the batch's runs (step logs, then the run and its event log) and its partition; idempotent.

    False, and nothing deleted, while one of its runs has not finished."""
    runs = instance.get_runs(dg.RunsFilter(tags={PARTITION_TAG: batch_id}))
    if any(not run.is_finished for run in runs):
        return False
    for run in runs:
        instance.compute_log_manager.delete_logs(prefix=[run.run_id])
        instance.delete_run(run.run_id)
        delete_run_leftovers(instance, run.run_id)
    instance.delete_dynamic_partition(BATCH_PARTITIONS, batch_id)
    return True


def sweep_staged_logs(instance: dg.DagsterInstance, older_than: float) -> int:
    """Remove the step logs a cloud compute log manager staged locally for runs that finished (or are gone) and
    that nothing touched since `older_than`; how many runs' logs were removed."""
    staged = staged_logs(instance)
    if staged is None or not staged[1].is_dir():
        return 0
    local, folder = staged
    removed = 0
    for entry in folder.iterdir():
        if not (_RUN_ID.match(entry.name) and (entry / "compute_logs").is_dir()):
            continue  # not a run's staged logs (the folder is /tmp by default)
        run = instance.get_run_by_id(entry.name)
        if (run is None or run.is_finished) and scratch.newest_mtime(entry) < older_than:
            local.delete_logs(prefix=[entry.name])
            removed += 1
    return removed


def _due(session, retention: Retention, cursor: tuple[int, int] | None, excess: int) -> list[Ended]:
    """The next ended batches to purge, in the order they ended: those past retention, and the first `excess` ones
    whatever their age (both are a head of the same order, so the longer is taken)."""
    now = repo.now()
    ended = ended_before(session, now, after=cursor, limit=BATCHES_PER_TICK)
    past = now - retention.history_retention_s if retention.history_retention_s > 0 else None
    aged = sum(1 for batch in ended if past is not None and batch.ended_at <= past)
    return ended[:max(aged, excess, 0)]


def _cursor(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    data = json.loads(text)
    return int(data["ended_at"]), int(data["pk"])


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Deletes the Dagster history (partition, runs, event and step logs) and the working files of "
    "batches that ended more than BATCH_HISTORY_RETENTION_S ago, or of those that ended first while there are more "
    "than BATCH_HISTORY_MAX_BATCHES batch partitions, and sweeps leftover scratch and staged logs.",
)
@timed
def history_retention_sensor(context: dg.SensorEvaluationContext, database: DatabaseResource,
                             storage: StorageResource, retention: Retention) -> dg.SkipReason:
    started, instance = time.monotonic(), context.instance
    swept_before = time.time() - retention.scratch_max_age_s
    try:
        swept = scratch.sweep(storage.scratch_dir, swept_before) + sweep_staged_logs(instance, swept_before)
    except OSError as exc:  # a folder it may not read: the history is deleted all the same
        context.log.warning(f"Could not sweep scratch and staged logs: {exc!r}")
        swept = 0
    excess = 0
    if retention.history_max_batches > 0:
        excess = len(instance.get_dynamic_partitions(BATCH_PARTITIONS)) - retention.history_max_batches
    if retention.history_retention_s <= 0 and excess <= 0:
        return dg.SkipReason(f"History is kept (no batch past retention, partitions within the bound); {swept} "
                             "leftover(s) swept.")
    cursor = _cursor(context.cursor)
    purged: list[Ended] = []
    with database.session() as session:
        due = _due(session, retention, cursor, excess)
        for batch in due:
            if time.monotonic() - started > TICK_BUDGET_S:
                break
            try:
                if not purge_history(instance, batch.batch_id):
                    context.log.warning(f"{batch.batch_id}: a run of it has not finished; its history is left")
                else:
                    folder = storage.folder(batch.batch_id)
                    folder.clear(keep=served_keys(session, folder))
                    record_stored_bytes(session, batch.batch_id, folder_bytes(session, folder))
                    purged.append(batch)
            except Exception as exc:  # the storage or the instance unreachable: the next tick starts here again
                context.log.error(f"{batch.batch_id}: could not delete its history ({exc!r}); retried next tick")
                break
            cursor = (batch.ended_at, batch.pk)
    if cursor is not None:
        context.update_cursor(json.dumps({"ended_at": cursor[0], "pk": cursor[1]}))
    if purged:
        forget_partition_status(instance, BATCH_ASSETS)
        shown = ", ".join(b.batch_id for b in purged[:10]) + (", ..." if len(purged) > 10 else "")
        context.log.info(f"Deleted the history of {len(purged)} batch(es): {shown}")
    return dg.SkipReason(f"{len(purged)} batch(es) past retention or the partition bound deleted; {swept} "
                         "leftover(s) swept.")
