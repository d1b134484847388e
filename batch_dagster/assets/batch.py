"""The batch lifecycle: input file -> validated requests -> shards -> shard results -> output files -> usage.

Every asset is partitioned by batch and idempotent: a re-run reuses what is already written
(a committed shard is never recomputed) and rewrites merged files whole.
"""


import hashlib
import os
import signal
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dagster as dg
import orjson
import pyarrow.parquet as pq
from dagster_aws.s3 import S3Resource

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.columnar import custom_ids, read_shard, shard_path, validate_to_parquet, write_shards
from batch_dagster.batchfile.registry import served_endpoints
from batch_dagster.batchfile.results import commit_shard, committed_shards, merge
from batch_dagster.batchfile.usage import Usage, cost_of, load_price_table
from batch_dagster.engine.base import EngineCrash
from batch_dagster.partitions import batches
from batch_dagster.resources import BatchStorage, VLLMResource
from batch_dagster.resources.transfer import fetch
from batch_dagster.settings import Settings

GROUP = "batch_lifecycle"
INFERENCE_RETRIES = 2
RUN_WATCH_S = 2.0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _md_table(rows: list[dict[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_none_")
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]).replace("|", "\\|").replace("\n", " ")[:120] for h in head) + " |")
    return dg.MetadataValue.md("\n".join(lines))


def _fetch_dropped_file(context: dg.AssetExecutionContext, storage: BatchStorage, batch_id: str,
                        source: dict[str, str], s3: S3Resource) -> None:
    """Bring a file dropped in S3 or the inbox to its File's path, then into the batch's folder."""
    file_path = Path(source["file_path"])
    started = time.perf_counter()
    size = fetch(source["uri"], file_path, s3.get_client)
    context.log.info(f"Fetched {source['uri']} ({size} bytes) in {time.perf_counter() - started:.1f}s")
    storage.put_input(batch_id, file_path)


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"json"},
    description="The batch's input file as uploaded, or fetched from the bucket or inbox it was dropped in.",
)
def batch_input(context: dg.AssetExecutionContext, storage: BatchStorage, s3: S3Resource) -> dg.MaterializeResult:
    batch_id = context.partition_key
    path = storage.input_path(batch_id)
    source = storage.source(batch_id)
    if not path.exists() and source is not None:
        _fetch_dropped_file(context, storage, batch_id, source, s3)
    if not path.exists():
        raise dg.Failure(f"No input file at {path}.", allow_retries=False)
    h = hashlib.sha256()
    lines = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            lines += chunk.count(b"\n")
    return dg.MaterializeResult(
        metadata={"path": dg.MetadataValue.path(str(path)), "bytes": path.stat().st_size, "lines": lines,
                  "sha256": h.hexdigest()},
        data_version=dg.DataVersion(h.hexdigest()),
    )


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[batch_input],
    description="The validated requests, one row per request (Parquet); an invalid file fails the batch.",
)
def validated_requests(
    context: dg.AssetExecutionContext, storage: BatchStorage, vllm: VLLMResource
) -> dg.MaterializeResult:
    batch_id = context.partition_key
    settings = Settings.from_env()
    out = storage.requests_path(batch_id)
    started = time.perf_counter()
    report = validate_to_parquet(
        storage.input_path(batch_id),
        out,
        limits=settings.limits,
        endpoint=storage.endpoint(batch_id),
        models=served_endpoints(vllm.registry()),
    )
    elapsed = time.perf_counter() - started
    size = storage.input_path(batch_id).stat().st_size
    storage.write_json(storage.validation_path(batch_id), report.to_dict() | {"validated_at": _now()})
    if not report.valid:
        first = report.errors[0]
        raise dg.Failure(
            description=f"The input file is invalid: {report.error_count} error(s); first at line "
            f"{first.line}: [{first.code}] {first.message}",
            metadata={"errors": _md_table([e.to_dict() for e in report.errors[:50]]),
                      "error_count": report.error_count},
            allow_retries=False,
        )
    context.log.info(f"{report.total_requests} valid requests for {report.model} at {report.endpoint}")
    head = pq.ParquetFile(out).read_row_group(0, columns=["custom_id", "prompt_chars", "body"]).slice(0, 5).to_pylist()
    preview = [{"custom_id": r["custom_id"], "prompt_chars": r["prompt_chars"], "body": r["body"][:100]} for r in head]
    return dg.MaterializeResult(
        metadata={
            "preview": _md_table(preview),
            "total_requests": report.total_requests,
            "model": report.model,
            "endpoint": report.endpoint,
            "validation_s": round(elapsed, 3),
            "validation_mb_s": round(size / 1e6 / max(elapsed, 1e-9), 1),
            "path": dg.MetadataValue.path(str(out)),
        }
    )


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[validated_requests],
    description="Requests cut into shards: shared prefixes and similar lengths together.",
)
def batch_shards(context: dg.AssetExecutionContext, storage: BatchStorage) -> dg.MaterializeResult:
    batch_id = context.partition_key
    shards_dir = storage.shards_dir(batch_id)
    manifest_path = shards_dir / "manifest.json"
    manifest = storage.read_json(manifest_path)
    if manifest is not None:
        # Results may already be committed against this plan: never re-cut it.
        context.log.info(f"Reusing the {manifest['shard_count']} shards already planned")
        return dg.MaterializeResult(metadata={"shard_count": manifest["shard_count"], "status": "cached"})
    validation = storage.read_json(storage.validation_path(batch_id))
    shard_size = Settings.from_env().shard_size
    sizes = write_shards(storage.requests_path(batch_id), shards_dir, shard_size)
    manifest = {
        "batch_id": batch_id,
        "endpoint": validation["endpoint"],
        "model": validation["model"],
        "total_requests": sum(sizes),
        "shard_size": shard_size,
        "shard_count": len(sizes),
        "shard_sizes": sizes,
    }
    # The manifest is written last: it is what marks the shards as planned and complete.
    storage.write_json(manifest_path, manifest)
    context.log.info(f"{sum(sizes)} requests in {len(sizes)} shards of up to {shard_size}")
    return dg.MaterializeResult(
        metadata={"shard_count": len(sizes), "shard_size": shard_size, "largest_shard": max(sizes)}
    )


class _ShardProgress:
    """Counts a shard's finished requests and writes them to storage at most once a second."""

    def __init__(self, storage: BatchStorage, batch_id: str, index: int, size: int):
        self.path, self.index, self.size = storage.progress_path(batch_id), index, size
        self.storage = storage
        self.done = 0
        self.written_at = 0.0

    def __call__(self, n: int) -> None:
        self.done = min(self.done + n, self.size)
        now = time.monotonic()
        if now - self.written_at >= 1.0 or self.done == self.size:
            self.written_at = now
            self.storage.write_json(self.path, {"shard": self.index, "done": self.done})


@contextmanager
def _dies_with_its_run(context: dg.AssetExecutionContext):
    """Within this block, the process is killed if its run is marked finished (failed) meanwhile.

    When a run worker is killed, its step process lives on as an orphan, inferring and committing
    shards, while the run retry starts a new run (and a second engine) on the same shards. The code
    server marks the dead worker's run failed within a second; the orphan then dies too.
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


def engine_error_lines(requests: list[tuple[str, dict[str, Any]]], reason: str) -> list[dict[str, Any]]:
    message = f"The engine failed on this shard after {INFERENCE_RETRIES + 1} attempts: {reason}"
    return [c.request_error_line(cid, c.ENGINE_ERROR, message, status_code=500) for cid, _ in requests]


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"vllm"},
    deps=[batch_shards],
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=INFERENCE_RETRIES, delay=2, backoff=dg.Backoff.EXPONENTIAL),
    description="Inference: each shard run on the engine and committed atomically; committed shards are skipped.",
)
def shard_results(
    context: dg.AssetExecutionContext, storage: BatchStorage, vllm: VLLMResource
) -> dg.MaterializeResult:
    batch_id = context.partition_key
    manifest = storage.read_json(storage.shards_dir(batch_id) / "manifest.json")
    results_dir = storage.results_dir(batch_id)
    done = committed_shards(results_dir)
    todo = [i for i in range(manifest["shard_count"]) if i not in done]
    context.log.info(
        f"{len(done)} of {manifest['shard_count']} shards already committed; running {len(todo)} "
        f"(attempt {context.retry_number + 1})"
    )
    engine = None  # built at the first shard that runs: a stopped batch never loads the model
    started = time.perf_counter()
    ran_requests = 0
    ran_tokens = 0
    stopped = None
    with _dies_with_its_run(context):
        for index in todo:
            stopped = storage.stop_reason(batch_id)
            if stopped:
                context.log.warning(f"Batch {stopped}: shard {index} and later are not run")
                break
            requests = read_shard(shard_path(storage.shards_dir(batch_id), index))
            engine = engine or vllm.engine(manifest["model"])
            t0 = time.perf_counter()
            try:
                progress = _ShardProgress(storage, batch_id, index, len(requests))
                lines = engine.run(manifest["endpoint"], requests, on_progress=progress)
            except EngineCrash as exc:
                vllm.reset(manifest["model"])
                if context.retry_number < INFERENCE_RETRIES:
                    context.log.error(f"Shard {index}: engine crashed ({exc}); the step will retry")
                    raise
                context.log.error(f"Shard {index}: engine crashed on the last attempt; its requests become errors")
                lines = engine_error_lines(requests, str(exc))
                engine = vllm.engine(manifest["model"])
            summary = commit_shard(results_dir, index, lines, time.perf_counter() - t0)
            ran_requests += summary.request_counts.total
            ran_tokens += summary.usage.output_tokens
            context.log.info(
                f"Shard {index}: {summary.request_counts.completed} completed, {summary.request_counts.failed} failed, "
                f"{summary.usage.output_tokens} output tokens in {summary.duration_s:.1f}s"
            )
    elapsed = time.perf_counter() - started
    all_done = committed_shards(results_dir)
    completed = sum(s.request_counts.completed for s in all_done.values())
    failed = sum(s.request_counts.failed for s in all_done.values())
    return dg.MaterializeResult(
        metadata={
            "shards_run": len(todo),
            "shards_skipped": len(done),
            "completed": completed,
            "failed": failed,
            "requests_run": ran_requests,
            "inference_s": round(elapsed, 3),
            "output_tokens_per_s": round(ran_tokens / elapsed, 1) if ran_requests else 0.0,
            "status": stopped or ("ran" if todo else "cached"),
        }
    )


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"json"},
    deps=[shard_results],
    description="The merged output file and error file, in the OpenAI Batch format.",
)
def batch_output_files(context: dg.AssetExecutionContext, storage: BatchStorage) -> dg.MaterializeResult:
    batch_id = context.partition_key
    manifest = storage.read_json(storage.shards_dir(batch_id) / "manifest.json")
    results_dir = storage.results_dir(batch_id)
    missing = [i for i in range(manifest["shard_count"]) if i not in committed_shards(results_dir)]
    stopped = storage.stop_reason(batch_id) if missing else None
    not_run = []
    if stopped:
        # The requests of shards that never ran still get a line each: nothing is dropped.
        code = c.BATCH_CANCELLED if stopped == "cancelled" else c.BATCH_EXPIRED
        message = f"The batch was {stopped} before this request ran."
        not_run = (
            c.not_run_line(cid, code, message)
            for i in missing
            for cid in custom_ids(shard_path(storage.shards_dir(batch_id), i))
        )
    result = merge(
        results_dir, manifest["shard_count"], storage.output_path(batch_id), storage.error_path(batch_id),
        not_run=not_run, missing_ok=bool(stopped),
    )
    storage.write_json(
        storage.batch_dir(batch_id) / "merged.json",
        {"status": stopped or "completed", "request_counts": result.request_counts.to_dict(),
         "usage": result.usage.to_dict(), "error_codes": result.error_codes},
    )
    preview = []
    with open(storage.output_path(batch_id), "rb") as f:
        for raw, _ in zip(f, range(3)):
            line = orjson.loads(raw)
            body = line["response"]["body"]
            choice = (body.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content", choice.get("text", "")) if choice else ""
            preview.append({"custom_id": line["custom_id"], "answer": text or f"[{body.get('object')}]"})
    return dg.MaterializeResult(
        metadata={
            "output_file": dg.MetadataValue.path(str(storage.output_path(batch_id))),
            "error_file": dg.MetadataValue.path(str(storage.error_path(batch_id))),
            "completed": result.request_counts.completed,
            "failed": result.request_counts.failed,
            "error_codes": dg.MetadataValue.json(result.error_codes),
            "preview": _md_table(preview),
        }
    )


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"json"},
    deps=[batch_output_files],
    description="Token usage and cost of the batch (successful requests only), and how it ran.",
)
def batch_usage(
    context: dg.AssetExecutionContext, storage: BatchStorage, vllm: VLLMResource
) -> dg.MaterializeResult:
    batch_id = context.partition_key
    settings = Settings.from_env()
    manifest = storage.read_json(storage.shards_dir(batch_id) / "manifest.json")
    merged = storage.read_json(storage.batch_dir(batch_id) / "merged.json")
    usage = Usage.from_dict(merged["usage"])
    prices = load_price_table(settings.prices_file)
    cost = cost_of(usage, manifest["model"], prices)
    shards = committed_shards(storage.results_dir(batch_id))
    inference_s = sum(s.duration_s for s in shards.values())
    summary = {
        "batch_id": batch_id,
        "status": merged["status"],
        "endpoint": manifest["endpoint"],
        "model": manifest["model"],
        "request_counts": merged["request_counts"],
        "usage": usage.to_dict(),
        "cost": cost.to_dict(),
        "error_codes": merged["error_codes"],
        "inference_s": round(inference_s, 3),
        "output_tokens_per_s": round(usage.output_tokens / inference_s, 1) if inference_s else 0.0,
        "record": vllm.model_record(manifest["model"]),
        "output_file": str(storage.output_path(batch_id)),
        "error_file": str(storage.error_path(batch_id)),
        "completed_at": _now(),
    }
    storage.write_json(storage.summary_path(batch_id), summary)
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
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "inference_s": summary["inference_s"],
            "model_revision": summary["record"]["revision"],
            "vllm_version": summary["record"]["vllm_version"],
            "engine": dg.MetadataValue.json(summary["record"]),
            "cost_detail": dg.MetadataValue.json(summary["cost"]),
        }
    )


lifecycle_assets = [batch_input, validated_requests, batch_shards, shard_results, batch_output_files, batch_usage]
