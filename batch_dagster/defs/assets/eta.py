"""A valid batch's estimate, made once by validation, and the ETA the inference step reports as its shards run.

The estimate is POST /v1/batches/estimate's answer for the batch's file (the queue without the batch itself),
written to the folder's estimate.json; the status sensor copies it onto the batch's record (db/lifecycle.py).
"""

from __future__ import annotations

import time
from typing import Any

import dagster as dg

from batch_dagster.batchfile.estimate import estimate_stream
from batch_dagster.batchfile.eta import bounded_work, running_remaining_s
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.registry import served_endpoints
from batch_dagster.db.estimate import measured_throughput, queue_ahead
from batch_dagster.db.session import open_database
from batch_dagster.defs.resources import PipelineConfig, VLLMResource


def write_estimate(context: dg.AssetExecutionContext, folder: BatchFolder, pipeline: PipelineConfig,
                   vllm: VLLMResource) -> dict[str, Any] | None:
    """Estimate the validated batch as the estimate endpoint would and write it; None (logged) when it cannot be
    made: the batch runs without one. A re-run keeps the one made first. Without the API's store (definitions
    that have none, as the fast tests') there is no queue and no rate to time it against: none is made."""
    if (made := folder.estimate()) is not None:
        return made
    if not pipeline.store_url:
        return None
    try:
        models = vllm.models
        size = folder.storage.size(folder.input_key) or 0
        with open_database(pipeline.store_url).session() as session, folder.storage.open(folder.input_key) as f:
            estimate = estimate_stream(
                f, size=size, limits=pipeline.limits, endpoint=folder.endpoint(),
                served=served_endpoints(models.registry()), counter=models.counter, prices=pipeline.prices(),
                throughput=lambda m: measured_throughput(session, folder.storage, m, pipeline.estimate_tokens_per_s),
                queue=lambda m: queue_ahead(session, m, exclude=folder.batch_id)).to_dict()
    except Exception as exc:  # a tokenizer or store failure: the batch is valid and runs; it shows no estimate
        context.log.warning(f"No estimate for this batch: {str(exc)[:500]}")
        return None
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
        # Its pace counts from this step's start, over the requests it finished (not those committed before).
        ran = (done - self.done_before) / self.total / share
        left = running_remaining_s(self.work * share, self.rate, ran, now - self.started)
        return dg.AssetObservation(asset_key=context.asset_key, partition=context.partition_key, metadata={
            "queue_position": 0, "requests_done": done, "fraction_done": round(done / self.total, 4),
            "estimated_completion_at": dg.MetadataValue.timestamp(now + left)})
