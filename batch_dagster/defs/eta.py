"""Queue position and ETA, the Dagster side: every batch not ended gets its place among its model's batches and its
estimated end (features/eta.py), stored on its record for the API, and on its run's tags for the Dagster UI; a running
batch's inference step reports its own ETA after each shard, as an observation of its asset."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime

import dagster as dg

from batch_dagster.batchfile.results import CommittedShard
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig
from batch_dagster.defs.run_limits import model_run_limit
from batch_dagster.defs.sensor_timing import timed
from batch_dagster.features.eta import RunningEta, refresh_queue
from batch_dagster.features.shards import Shard, ShardFeature

POSITION_TAG, ETA_TAG = "batch/queue_position", "batch/estimated_completion_at"


@dg.sensor(
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps each unfinished batch's queue_position and estimated_completion_at up to date (the API "
    "shows them); a run's tags show its batch's place while it waits in the run queue.",
)
@timed
def queue_eta_sensor(context: dg.SensorEvaluationContext, database: DatabaseResource,
                     pipeline: PipelineConfig) -> dg.SkipReason:
    # The run queue's own limit; an instance without one (a test's) counts the settings' number.
    slots = model_run_limit(context.instance) or pipeline.runs_per_model
    with database.session() as session:
        refreshed = refresh_queue(session, slots=slots,
                                  default_tokens_per_s=pipeline.estimate_tokens_per_s, now=time.time())
    for m in refreshed.at_risk:
        eta = datetime.fromtimestamp(m.place.estimated_completion_at, UTC).isoformat(timespec="seconds")
        context.log.warning(f"{m.batch_id}: estimated to end at {eta}, after its deadline (batch.deadline_at_risk)")
    tagged, moved = 0, refreshed.moved
    for m in moved:
        if m.run_id is None or not m.new_position:
            continue  # the tags follow the place (the end moves on every tick while a batch runs)
        eta = datetime.fromtimestamp(m.place.estimated_completion_at, UTC).isoformat(timespec="seconds")
        try:
            context.instance.add_run_tags(m.run_id, {POSITION_TAG: str(m.place.queue_position), ETA_TAG: eta})
            tagged += 1
        except Exception as exc:  # a run deleted meanwhile: the record holds the place anyway
            context.log.warning(f"{m.batch_id}: could not tag run {m.run_id} ({str(exc)[:300]})")
    return dg.SkipReason(f"{len(moved)} batch(es) moved in the queue or in time; {tagged} run(s) tagged.")


class EtaObservations(ShardFeature):
    """After each shard, the inference step's own ETA once the batch's committed requests have finished: its progress
    blended with its estimate's work at the estimate's rate (features/eta.py RunningEta), observed on its asset."""

    def __init__(self, context: dg.AssetExecutionContext, eta: RunningEta):
        self.context, self.eta = context, eta

    def after(self, shard: Shard, done: Mapping[int, CommittedShard]) -> None:
        finished, now = sum(s.request_counts.total for s in done.values()), time.time()
        left = self.eta.remaining_s(finished, now) or 0.0
        context = self.context
        partition = context.partition_key if context.has_partition_key else None  # a table batch's may have none
        context.log_event(dg.AssetObservation(asset_key=context.asset_key, partition=partition, metadata={
            "queue_position": 0, "requests_done": finished, "fraction_done": round(finished / self.eta.total, 4),
            "estimated_completion_at": dg.MetadataValue.timestamp(now + left)}))
