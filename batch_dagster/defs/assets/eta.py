"""A valid batch's estimate, made once by validation, and the ETA the inference step reports as its shards run.

The estimate is POST /v1/batches/estimate's answer for the batch's file (the queue without the batch itself),
written to the folder's estimate.json; the status sensor copies it onto the batch's record (db/lifecycle.py).
"""

from __future__ import annotations

import time
from typing import Any

import dagster as dg

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.session import open_database
from batch_dagster.defs.resources import PipelineConfig
from batch_dagster.features.estimate import Estimate, Tally
from batch_dagster.features.eta import bounded_work, running_remaining_s
from batch_dagster.features.throughput import measured_throughput, queue_ahead


def write_estimate(context: dg.AssetExecutionContext, folder: BatchFolder, report: ValidationReport,
                   tally: Tally | None, pipeline: PipelineConfig) -> dict[str, Any] | None:
    """The valid batch's estimate, as the estimate endpoint answers for its file (validation's `report` and `tally`,
    the model's measured rate, the queue without the batch itself), written to its folder; a re-run keeps the one
    made first. None without a tally or a store (no queue, no rate: definitions without one, as the fast tests'), or
    when the store fails (logged): the batch runs without one."""
    if (made := folder.estimate()) is not None:
        return made
    if tally is None or report.model is None or not pipeline.store_url:
        return None
    model = report.model
    try:
        with open_database(pipeline.store_url).session() as session:
            throughput = measured_throughput(session, folder.storage, model, pipeline.estimate_tokens_per_s)
            queue = queue_ahead(session, model, exclude=folder.batch_id)
    except Exception as exc:  # the store unreachable: the batch is valid and runs; it shows no estimate
        context.log.warning(f"No estimate for this batch: {str(exc)[:500]}")
        return None
    estimate = Estimate(report, tally, pipeline.prices(), throughput, queue).to_dict()
    folder.write_estimate(estimate)
    return estimate


def estimate_metadata(estimate: dict[str, Any] | None) -> dict[str, Any]:
    """The estimate as the validated_requests materialization shows it."""
    if not estimate or not estimate.get("valid"):
        return {}
    duration, cost = estimate.get("duration_s") or {}, estimate.get("cost") or {}
    return {"estimated_input_tokens": estimate["input_tokens"], "estimated_max_output_tokens":
            estimate["max_output_tokens"], **({"estimated_duration_s_max": duration["max"]} if duration else {}),
            **({"estimated_cost_max": cost["max"]} if cost else {})}


class RunEta:
    """The inference step's own ETA: its progress (requests finished over the batch's) blended with the
    estimate's tokens at the estimate's measured rate (batchfile/eta.py running_remaining_s)."""

    def __init__(self, folder: BatchFolder, total_requests: int, done_before: int):
        estimate = folder.estimate()
        self.work = bounded_work(estimate) or 0.0
        self.rate = float((estimate or {}).get("tokens_per_s") or 0.0)
        self.total, self.done_before, self.started = max(total_requests, 1), done_before, time.time()

    def observation(self, context: dg.AssetExecutionContext, done: int) -> dg.AssetObservation:
        now = time.time()
        share = max(1 - self.done_before / self.total, 1e-9)  # the part of the batch this step runs
        # Its time counts from this step's start, its fraction over the requests it finished (not those committed
        # before).
        ran = (done - self.done_before) / self.total / share
        left = running_remaining_s(self.work * share, self.rate, ran, now - self.started)
        return dg.AssetObservation(asset_key=context.asset_key, partition=context.partition_key, metadata={
            "queue_position": 0, "requests_done": done, "fraction_done": round(done / self.total, 4),
            "estimated_completion_at": dg.MetadataValue.timestamp(now + left)})
