"""The batch lifecycle: input file -> validated requests -> shards -> shard results -> output files -> usage.

Every asset is partitioned by batch and idempotent: a re-run reuses what is already written
(a committed shard is never recomputed) and rewrites merged files whole. Each step's work is in steps.py and
inference.py, which table batches run too. Each step is defined once, here (`step`); `lifecycle` makes the assets when
the definitions load, and the rest of the definitions name them by key (LIFECYCLE).
"""

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import dagster as dg
from dagster_aws.s3 import S3Resource

from batch_dagster.batchfile.folder import BatchFolder, Source
from batch_dagster.batchfile.table_files import is_table
from batch_dagster.db import repo
from batch_dagster.db.lifecycle import sync_batch
from batch_dagster.defs.assets.dropped_tables import fetch_dropped_table
from batch_dagster.defs.k8s import GPU_STEP_TAGS
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource, VLLMResource
from batch_dagster.storage import file_location
from batch_dagster.storage.transfer import fetch

from . import inference, steps

GROUP = "batch_lifecycle"
_STEPS: list[tuple[Callable[..., Any], bool, dict[str, Any]]] = []


def step(*, retried: bool = False, **asset: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A lifecycle step: its body, and beside it its asset's attributes (dg.asset's, partitioned by batch, in GROUP);
    `retried`: given the step RetryPolicy (inference.step_retries) when the definitions load."""
    def declare(body: Callable[..., Any]) -> Callable[..., Any]:
        _STEPS.append((body, retried, asset))
        return body

    return declare


def lifecycle(retry_delay_s: float) -> list[dg.AssetsDefinition]:
    """The lifecycle's assets, in data-flow order, its retried steps retried after `retry_delay_s`
    (BATCH_STEP_RETRY_DELAY_S, read when the definitions load)."""
    retries = inference.step_retries(retry_delay_s)
    return [dg.asset(partitions_def=batches, group_name=GROUP, retry_policy=retries if retried else None, **asset)(body)
            for body, retried, asset in _STEPS]


LABEL_TAGS = ("filename", "source", "owner")


def _labels(context: dg.AssetExecutionContext) -> dict[str, str]:
    """The batch's readable labels (input filename, source, owner label), as its run was tagged."""
    return {k: context.run.tags[k] for k in LABEL_TAGS if k in context.run.tags}


def _tag_run(context: dg.AssetExecutionContext, model: str | None, requests: int, status: str) -> None:
    """Put what validation found on the run, so the runs list tells batches apart."""
    tags = {"model": model or "unknown", "requests": str(requests), "validation": status}
    context.instance.add_run_tags(context.run.run_id, tags)


def _fetch_dropped_file(context: dg.AssetExecutionContext, folder: BatchFolder, source: Source,
                        s3: S3Resource) -> None:
    """Bring a file dropped in S3 or the inbox into its File, then into the batch's folder."""
    started = time.perf_counter()
    files, key = file_location(folder.storage, source.file_path)
    with files.writing(key) as local:
        size = fetch(source.uri, local, s3.get_client)
        folder.put_input(local)
    context.log.info(f"Fetched {source.uri} ({size} bytes) in {time.perf_counter() - started:.1f}s")


@step(
    kinds={"json"},
    description="The batch's input file as uploaded, or fetched from the bucket or inbox it was dropped in (a dropped "
                "Parquet or CSV table: its rows rendered into requests as its sidecar says).",
)
def batch_input(context: dg.AssetExecutionContext, storage: StorageResource, s3: S3Resource,
                pipeline: PipelineConfig) -> dg.MaterializeResult:
    folder = storage.folder(context.partition_key)
    where = folder.storage.uri(folder.input_key)
    source = folder.source()
    if not folder.has_input() and source is not None:
        if is_table(source.uri):  # a Parquet or CSV file with its sidecar: its rows become the input file
            fetch_dropped_table(context, folder, source, s3.get_client(), pipeline.limits)
        else:
            _fetch_dropped_file(context, folder, source, s3)
    if not folder.has_input():
        raise dg.Failure(f"No input file at {where}.", allow_retries=False)
    h = hashlib.sha256()
    lines = size = 0
    with folder.storage.open(folder.input_key) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            lines += chunk.count(b"\n")
            size += len(chunk)
    return dg.MaterializeResult(
        metadata={**_labels(context), "path": dg.MetadataValue.path(where), "bytes": size,
                  "lines": lines, "sha256": h.hexdigest()},
        data_version=dg.DataVersion(h.hexdigest()),
    )


@step(
    kinds={"parquet"},
    deps=["batch_input"],
    output_required=False,
    description="The validated requests, one row per request (Parquet). An invalid file is a result, not a "
                "failure: it is recorded as an `invalid` observation with its errors, and the steps after this "
                "one are skipped.",
)
def validated_requests(
    context: dg.AssetExecutionContext, storage: StorageResource, pipeline: PipelineConfig, vllm: VLLMResource,
    database: DatabaseResource,
) -> Iterator[dg.MaterializeResult]:
    folder = storage.folder(context.partition_key)
    with database.step_session() as session:  # the token limit, the cost cap and the estimate read the store
        validated = steps.validate(folder, pipeline, vllm, session, context.log)
    report = validated.report
    if not report.valid:
        # No materialization: Dagster skips the downstream steps and their checks instead of failing them,
        # and the run succeeds. The batch's status (failed, with errors.data) comes from validation.json.
        first = report.errors[0]
        where = f"line {first.line}" if first.line is not None else "the file"
        _tag_run(context, report.shown_model, report.total_requests, "invalid")
        context.log.warning(f"The input file is invalid: {report.error_count} error(s); first at {where}: "
                            f"[{first.code}] {first.message}. The later steps are skipped.")
        context.log_event(dg.AssetObservation(
            asset_key=context.asset_key,
            partition=context.partition_key,
            metadata={"status": "invalid", **_labels(context), "error_count": report.error_count,
                      "total_requests": report.total_requests,
                      "errors": steps.md_table([e.to_dict() for e in report.errors[:50]]),
                      **({"model": report.shown_model} if report.shown_model else {})},
        ))
        return
    _tag_run(context, report.model, report.total_requests, "valid")
    context.log.info(f"{report.total_requests} valid requests for {report.model} at {report.endpoint}")
    head = [{"custom_id": r["custom_id"], "prompt_chars": r["prompt_chars"], "body": r["body"][:100]}
            for r in validated.head]
    elapsed = validated.elapsed_s
    yield dg.MaterializeResult(
        metadata={
            "status": "valid",
            **_labels(context),
            "preview": steps.md_table(head),
            "total_requests": report.total_requests,
            "model": report.model,
            "endpoint": report.endpoint,
            "validation_s": round(elapsed, 3),
            "validation_mb_s": round(validated.size / 1e6 / max(elapsed, 1e-9), 1),
            **steps.estimate_metadata(validated.estimate),
            "path": dg.MetadataValue.path(folder.storage.uri(folder.requests_key)),
        }
    )


@step(
    kinds={"parquet"},
    deps=["validated_requests"],
    description="Requests cut into shards: shared prefixes and similar lengths together.",
)
def batch_shards(
    context: dg.AssetExecutionContext, storage: StorageResource, pipeline: PipelineConfig
) -> dg.MaterializeResult:
    manifest, cached = steps.plan_shards(storage.folder(context.partition_key), pipeline, context.log)
    if cached:
        return dg.MaterializeResult(metadata={"shard_count": manifest.shard_count, "status": "cached"})
    return dg.MaterializeResult(
        metadata={"shard_count": manifest.shard_count, "shard_size": manifest.shard_size,
                  "largest_shard": max(manifest.shard_sizes)}
    )


@step(
    retried=True,
    kinds={"vllm"},
    deps=["batch_shards"],
    op_tags=GPU_STEP_TAGS,
    description="Inference: each shard run on the engine and committed atomically; committed shards are skipped.",
)
def shard_results(
    context: dg.AssetExecutionContext, storage: StorageResource, vllm: VLLMResource, pipeline: PipelineConfig,
    database: DatabaseResource,
) -> dg.MaterializeResult:
    with database.step_session() as session:  # the cost cap reads the store; the batch's spend is kept there
        done = inference.infer(context, storage.folder(context.partition_key), vllm, pipeline, session)
    return dg.MaterializeResult(metadata=done.metadata())


@step(
    retried=True,
    kinds={"json"},
    deps=["shard_results"],
    description="The merged output file and error file, in the OpenAI Batch format.",
)
def batch_output_files(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    folder = storage.folder(context.partition_key)
    result, preview = steps.merge_results(folder)
    return dg.MaterializeResult(
        metadata={
            "output_file": dg.MetadataValue.path(folder.storage.uri(folder.output_key)),
            "error_file": dg.MetadataValue.path(folder.storage.uri(folder.error_key)),
            "completed": result.request_counts.completed,
            "failed": result.request_counts.failed,
            "error_codes": dg.MetadataValue.json(result.error_codes),
            "preview": steps.md_table(preview),
        }
    )


def store_end(context: dg.AssetExecutionContext, database: DatabaseResource, storage: StorageResource) -> None:
    """The batch's end stored by its own run once its summary is written, so that the API answers it at once, not at
    the status sensor's next tick. Either may store it first: sync_batch applies an end once (its files registered
    and its webhook event added once). A batch with no row (a table batch) has none to store; a store that fails here
    is left to the sensor."""
    try:
        with database.step_session() as session:
            if session is None:
                return
            for batch in repo.active_batches_by_id(session, [context.partition_key]):
                before = batch.status
                batch.run_id = context.run.run_id  # the batch's latest run: this one
                sync_batch(session, storage.open(), batch)
                session.commit()  # the run id, where sync_batch found nothing else to store
                if batch.status != before:  # as the status sensor logs the changes it stores
                    context.log.info(f"{batch.id}: {before} -> {batch.status}")
    except Exception as exc:
        context.log.warning(f"The batch's end was not stored by its run ({str(exc)[:500]}); the status sensor "
                            "stores it")


@step(
    retried=True,
    kinds={"json"},
    deps=["batch_output_files"],
    description="Token usage and cost of the batch (successful requests only), and how it ran.",
)
def batch_usage(
    context: dg.AssetExecutionContext, storage: StorageResource, pipeline: PipelineConfig, vllm: VLLMResource,
    database: DatabaseResource,
) -> dg.MaterializeResult:
    summary = steps.summarize(storage.folder(context.partition_key), pipeline, vllm, context.log)
    store_end(context, database, storage)
    usage, cost = summary.usage, summary.cost
    context.log.info(
        f"{usage.input_tokens} input + {usage.output_tokens} output tokens; cost {cost.total_cost} {cost.currency}"
    )
    return dg.MaterializeResult(
        metadata={
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "total_tokens": usage.total_tokens,
            "cost": cost.total_cost,
            "currency": cost.currency,
            "output_tokens_per_s": summary.output_tokens_per_s,
            "inference_s": summary.inference_s,
            "model_revision": summary.record["revision"],
            "vllm_version": summary.record["vllm_version"],
            "engine": dg.MetadataValue.json(summary.record),
            "cost_detail": dg.MetadataValue.json(cost.to_dict()),
            **({"price": f"not in the price table: its [defaults] ({pipeline.prices_file})"}
               if pipeline.prices().unlisted(summary.model) else {}),
        }
    )


# The lifecycle's asset keys, in data-flow order: what the job, the checks, the delivery and retention name.
LIFECYCLE = tuple(dg.AssetKey(body.__name__) for body, _, _ in _STEPS)
