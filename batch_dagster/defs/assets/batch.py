"""The batch lifecycle: input file -> validated requests -> shards -> shard results -> output files -> usage.

Every asset is partitioned by batch and idempotent: a re-run reuses what is already written
(a committed shard is never recomputed) and rewrites merged files whole.
"""

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import orjson
import pyarrow.parquet as pq
from dagster_aws.s3 import S3Resource
from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.columnar import read_shard, validate_to_parquet, write_shards
from batch_dagster.batchfile.failure import COST_LIMIT, ERROR_RATE, breaker_tripped, not_run_lines, stopped_ending
from batch_dagster.batchfile.folder import (
    BatchFolder,
    Manifest,
    Merged,
    Progress,
    Source,
    Summary,
    Validation,
)
from batch_dagster.batchfile.registry import served
from batch_dagster.batchfile.results import CommittedShard, commit_shard, committed_shards, merge, progress_of
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.structured import asks_structured
from batch_dagster.batchfile.usage import cost_of
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.lifecycle import record_usage
from batch_dagster.db.models import BatchRecord
from batch_dagster.defs.dagster_internals import dies_with_its_run
from batch_dagster.defs.k8s import GPU_STEP_TAGS
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource, VLLMResource
from batch_dagster.egress import Allow
from batch_dagster.engine.base import EngineCrash
from batch_dagster.features.cost_cap import cap_reached, refuse_over_cap
from batch_dagster.features.estimate import Tally, count_tokens, write_estimate
from batch_dagster.features.eta import RunningEta
from batch_dagster.features.token_limit import refuse_over_limit
from batch_dagster.image_fetch import ImageFetcher
from batch_dagster.settings import default
from batch_dagster.storage import file_location
from batch_dagster.storage.transfer import fetch

GROUP = "batch_lifecycle"
INFERENCE_RETRIES = 2


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _md_table(rows: list[dict[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_none_")
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]).replace("|", "\\|").replace("\n", " ")[:120] for h in head) + " |")
    return dg.MetadataValue.md("\n".join(lines))


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


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"json"},
    description="The batch's input file as uploaded, or fetched from the bucket or inbox it was dropped in.",
)
def batch_input(context: dg.AssetExecutionContext, storage: StorageResource, s3: S3Resource) -> dg.MaterializeResult:
    folder = storage.folder(context.partition_key)
    where = folder.storage.uri(folder.input_key)
    source = folder.source()
    if not folder.has_input() and source is not None:
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


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[batch_input],
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
        yield from _validate(context, folder, pipeline, vllm, session)


def _validate(context: dg.AssetExecutionContext, folder: BatchFolder, pipeline: PipelineConfig, vllm: VLLMResource,
              session: Session | None) -> Iterator[dg.MaterializeResult]:
    """Validate the batch's input into its requests file, count its tokens once, and refuse it past its owner's
    token limit or its cost cap; a valid batch gets its estimate."""
    started = time.perf_counter()
    size = folder.storage.size(folder.input_key) or 0
    # The input is validated as it streams in; the requests file is published only when the file is valid.
    with folder.storage.open(folder.input_key) as source, folder.storage.writing(folder.requests_key) as out:
        report = validate_to_parquet(
            source,
            out,
            size=size,
            limits=pipeline.limits,
            endpoint=folder.endpoint(),
            models=served(vllm.registry(), pipeline.image_sources),
        )
        elapsed = time.perf_counter() - started
        # The one count of its tokens: a limit that must hold fails the step when the tokenizer fails. Without a
        # limit and a store (no queue, no key, no cap: a run of the definitions alone) nothing reads it.
        # A batch cancelled (or expired) before its run started runs nothing: its requests are only listed.
        limit, budget = pipeline.max_enqueued_tokens, pipeline.key_daily_budget
        stopped = folder.stop_reason() is not None
        tally = count_tokens(out, report, vllm.models, needed=bool(limit or budget), log=context.log) \
            if (limit or session is not None) and not stopped else None
        prompt_tokens = refuse_over_limit(session, folder, report, limit, tally)
        if session is not None and not stopped:
            refuse_over_cap(session, folder.batch_id, report, tally, pipeline.prices(), budget,
                            folder.completion_window())
        head = (pq.ParquetFile(out).read_row_group(0, columns=["custom_id", "prompt_chars", "body"]).slice(0, 5)
                .to_pylist() if report.valid else [])
        if not report.valid:
            out.unlink(missing_ok=True)  # over the token limit or the cost cap: valid rows, but the batch is refused
    folder.write_validation(Validation(
        valid=report.valid, total_requests=report.total_requests, model=report.shown_model, endpoint=report.endpoint,
        error_count=report.error_count, errors=report.listed_errors, validated_at=_now(), prompt_tokens=prompt_tokens))
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
                      "errors": _md_table([e.to_dict() for e in report.errors[:50]]),
                      **({"model": report.shown_model} if report.shown_model else {})},
        ))
        return
    _tag_run(context, report.model, report.total_requests, "valid")
    context.log.info(f"{report.total_requests} valid requests for {report.model} at {report.endpoint}")
    estimate = _estimate(context, session, folder, report, tally, pipeline)
    preview = [{"custom_id": r["custom_id"], "prompt_chars": r["prompt_chars"], "body": r["body"][:100]} for r in head]
    yield dg.MaterializeResult(
        metadata={
            "status": "valid",
            **_labels(context),
            "preview": _md_table(preview),
            "total_requests": report.total_requests,
            "model": report.model,
            "endpoint": report.endpoint,
            "validation_s": round(elapsed, 3),
            "validation_mb_s": round(size / 1e6 / max(elapsed, 1e-9), 1),
            **_estimate_metadata(estimate),
            "path": dg.MetadataValue.path(folder.storage.uri(folder.requests_key)),
        }
    )


def _estimate(context: dg.AssetExecutionContext, session: Session | None, folder: BatchFolder,
              report: ValidationReport, tally: Tally | None, pipeline: PipelineConfig) -> dict[str, Any] | None:
    """The valid batch's estimate (features/estimate.py write_estimate), or None: without a tally or a store (no
    queue, no rate), or when the store fails (logged): the batch is valid and runs; it shows no estimate."""
    if (made := folder.estimate()) is not None:
        return made
    if tally is None or session is None:
        return None
    try:
        return write_estimate(session, folder, report, tally, pipeline.prices(), pipeline.estimate_tokens_per_s)
    except Exception as exc:  # the store unreachable
        context.log.warning(f"No estimate for this batch: {str(exc)[:500]}")
        return None


def _estimate_metadata(estimate: dict[str, Any] | None) -> dict[str, Any]:
    """The estimate as the validated_requests materialization shows it."""
    if not estimate or not estimate.get("valid"):
        return {}
    duration, cost = estimate.get("duration_s") or {}, estimate.get("cost") or {}
    return {"estimated_input_tokens": estimate["input_tokens"], "estimated_max_output_tokens":
            estimate["max_output_tokens"], **({"estimated_duration_s_max": duration["max"]} if duration else {}),
            **({"estimated_cost_max": cost["max"]} if cost else {})}


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"parquet"},
    deps=[validated_requests],
    description="Requests cut into shards: shared prefixes and similar lengths together.",
)
def batch_shards(
    context: dg.AssetExecutionContext, storage: StorageResource, pipeline: PipelineConfig
) -> dg.MaterializeResult:
    folder = storage.folder(context.partition_key)
    manifest = folder.manifest()
    if manifest is not None:
        # Results may already be committed against this plan: never re-cut it.
        context.log.info(f"Reusing the {manifest.shard_count} shards already planned")
        return dg.MaterializeResult(metadata={"shard_count": manifest.shard_count, "status": "cached"})
    validation = folder.validation()
    assert validation is not None and validation.model and validation.endpoint  # validated_requests ran
    shard_size = pipeline.shard_size
    with folder.storage.local_copy(folder.requests_key) as requests, \
            folder.storage.writing_folder(folder.shards_prefix) as shards:
        sizes = write_shards(requests, shards, shard_size)
    # The manifest is written last: it is what marks the shards as planned and complete.
    folder.write_manifest(Manifest(
        batch_id=folder.batch_id, endpoint=validation.endpoint, model=validation.model, total_requests=sum(sizes),
        shard_size=shard_size, shard_count=len(sizes), shard_sizes=sizes,
    ))
    context.log.info(f"{sum(sizes)} requests in {len(sizes)} shards of up to {shard_size}")
    return dg.MaterializeResult(
        metadata={"shard_count": len(sizes), "shard_size": shard_size, "largest_shard": max(sizes)}
    )


class _ShardProgress:
    """Counts a shard's finished requests: writes them to the progress document beside the committed totals
    (`base`; the API's live request_counts read them) at most once a second or every 5% of the shard; logs them
    with the engine's load every 5 s and every 10%."""

    WRITE_EVERY_S = 1.0
    LOG_EVERY_S = 5.0

    def __init__(self, folder: BatchFolder, base: Progress, index: int, size: int, log: Any = None):
        self.folder, self.base, self.index, self.size, self.log = folder, base, index, size, log
        self.done = 0
        self.written_at = 0.0
        self.written_done = 0
        self.logged_at = time.monotonic()
        self.first: tuple[float, int] | None = None
        self.logged_decile = 0
        self.load = ""

    def report_load(self, load: str) -> None:
        """The engine's own view of its load (e.g. vLLM's unfinished requests and token rates)."""
        self.load = load

    def __call__(self, n: int) -> None:
        self.done = min(self.done + n, self.size)
        now = time.monotonic()
        step = max(self.size // 20, 1)
        if (now - self.written_at >= self.WRITE_EVERY_S or self.done - self.written_done >= step
                or self.done == self.size):
            self.written_at, self.written_done = now, self.done
            self.folder.write_progress(replace(self.base, shard=self.index, done=self.done, updated_at=time.time()))
        decile = 10 * self.done // self.size
        if self.first is None:  # the rate counts from the first finished request: the engine's start is not in it
            self.first = (now, self.done)
        if self.log is not None and (now - self.logged_at >= self.LOG_EVERY_S or decile > self.logged_decile):
            self.logged_at, self.logged_decile = now, decile
            since, done_then = self.first
            rate = f", {(self.done - done_then) / (now - since):.1f} requests/s" if now - since >= 0.5 else ""
            load = f"; engine: {self.load}" if self.load else ""
            self.log.info(f"Shard {self.index}: {self.done}/{self.size} requests "
                          f"({100 * self.done // self.size}%){rate}{load}")


@contextmanager
def stops_when_terminated(context: dg.AssetExecutionContext) -> Iterator[None]:
    """A run terminated on purpose (the UI's Terminate: the run is CANCELING) ends this step for good, keeping its
    committed shards. Dagster 1.13 answers the interrupt with the step's RetryPolicy, so the step would run the
    batch on. Any other interrupt (serve stopped, the process signalled) is Dagster's to handle, as before."""
    try:
        yield
    except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt) as exc:
        run = context.instance.get_run_by_id(context.run.run_id)
        if run is None or run.status != dg.DagsterRunStatus.CANCELING:
            raise
        raise dg.Failure("The run was terminated while it ran the batch's shards.", allow_retries=False) from exc


def engine_error_lines(requests: list[tuple[str, dict[str, Any]]], reason: str) -> list[dict[str, Any]]:
    message = f"The engine failed on this shard after {INFERENCE_RETRIES + 1} attempts: {reason}"
    return [c.request_error_line(cid, c.ENGINE_ERROR, message, status_code=500) for cid, _ in requests]


def run_shards(
    context: dg.AssetExecutionContext, storage: StorageResource, vllm: VLLMResource, pipeline: PipelineConfig,
    database: DatabaseResource,
) -> dg.MaterializeResult:
    with database.step_session() as session:  # the cost cap reads the store; the batch's spend is kept there
        return _run_shards(context, storage.folder(context.partition_key), vllm, pipeline, session)


def _over_cost_cap(session: Session | None, folder: BatchFolder, model: str, committed: dict[int, CommittedShard],
                   pipeline: PipelineConfig) -> bool:
    """Whether the batch's spend has reached its cost cap (none without a store); the store's transaction ends
    here, so none is held while a shard runs."""
    if session is None:
        return False
    reached = cap_reached(session, folder.batch_id, model, committed.values(), pipeline.prices(),
                          pipeline.key_daily_budget, folder.completion_window())
    session.commit()
    return reached


def _breaker_rate(session: Session | None, batch_id: str, pipeline: PipelineConfig) -> float | None:
    """The batch's own error_breaker_rate (an API batch's option), else the operator's; the store's transaction ends
    here."""
    if session is None:
        return pipeline.error_breaker_rate
    row = session.scalar(select(BatchRecord).where(BatchRecord.id == batch_id))
    own = row.options.error_breaker_rate if row is not None else None
    session.commit()
    return own if own is not None else pipeline.error_breaker_rate


def _run_shards(context: dg.AssetExecutionContext, folder: BatchFolder, vllm: VLLMResource, pipeline: PipelineConfig,
                session: Session | None) -> dg.MaterializeResult:
    manifest = _manifest(folder)
    done = committed_shards(folder.storage, folder.results_prefix)
    todo = [i for i in range(manifest.shard_count) if i not in done]
    context.log.info(
        f"{len(done)} of {manifest.shard_count} shards already committed; running {len(todo)} "
        f"(attempt {context.retry_number + 1})"
    )
    # Rewritten first: an attempt killed between a shard's marker and the document left it behind.
    before = folder.progress()
    base = progress_of(done, manifest.total_requests, manifest.shard_count, before.committed_at if before else None)
    folder.write_progress(base)
    engine = None  # built at the first shard that runs: a stopped batch never loads the model
    images = ImageFetcher(folder, pipeline.image_sources, Allow.parse(pipeline.fetch_allow)) \
        if vllm.spec(manifest.model).images_per_request else None
    started = time.perf_counter()
    ran_requests = 0
    ran_tokens = 0
    stopped = None
    eta = RunningEta.of(folder.estimate(), manifest.total_requests, sum(s.request_counts.total for s in done.values()))
    with dies_with_its_run(context), stops_when_terminated(context):
        for index in todo:
            stopped = folder.stop_reason()
            if not stopped and _over_cost_cap(session, folder, manifest.model, done, pipeline):
                folder.request_stop(COST_LIMIT)  # as a cancel stops it: the status follows from the files
                stopped = COST_LIMIT
            if not stopped and breaker_tripped((s.request_counts for s in done.values()), pipeline.error_breaker_lines,
                                               _breaker_rate(session, folder.batch_id, pipeline)):
                folder.request_stop(ERROR_RATE)  # no more engine time for a batch whose lines nearly all fail
                stopped = ERROR_RATE
            if stopped:
                context.log.warning(f"Batch {stopped}: shard {index} and later are not run")
                break
            with folder.storage.local_copy(folder.shard_key(index)) as shard:
                requests = read_shard(shard)
            engine = engine or vllm.engine(manifest.model)
            t0 = time.perf_counter()
            try:
                progress = _ShardProgress(folder, base, index, len(requests), context.log)
                # Images named by URL, fetched once per batch: a request whose image cannot be had is its 400 line.
                sent, unfetched = images.inline(manifest.endpoint, requests) if images else (requests, [])
                if unfetched:
                    progress(len(unfetched))
                lines = engine.run(manifest.endpoint, sent, on_progress=progress) + unfetched
            except EngineCrash as exc:
                vllm.reset(manifest.model)
                if context.retry_number < INFERENCE_RETRIES:
                    context.log.error(f"Shard {index}: engine crashed ({exc}); the step will retry")
                    raise
                context.log.error(f"Shard {index}: engine crashed on the last attempt; its requests become errors")
                lines = engine_error_lines(requests, str(exc))
                engine = vllm.engine(manifest.model)
            structured = {cid for cid, body in requests if asks_structured(manifest.endpoint, body)}
            committed = commit_shard(folder.storage, folder.results_prefix, index, lines, time.perf_counter() - t0,
                                     engine_start_s=vllm.engine_start_s(manifest.model, t0), structured=structured)
            done[index] = committed
            base = progress_of(done, manifest.total_requests, manifest.shard_count)  # after the marker
            folder.write_progress(base)
            if session is not None:  # what the batch has spent, where other batches' cost caps read it
                record_usage(session, folder.batch_id, base.usage)
            context.log_event(_eta_observation(context, eta, sum(s.request_counts.total for s in done.values())))
            ran_requests += committed.request_counts.total
            ran_tokens += committed.usage.output_tokens
            counts = committed.request_counts
            context.log.info(f"Shard {index}: {counts.completed} completed, {counts.failed} failed, "
                             f"{committed.usage.output_tokens} output tokens in {committed.duration_s:.1f}s")
    elapsed = time.perf_counter() - started
    completed = sum(s.request_counts.completed for s in done.values())  # those committed before, and now
    failed = sum(s.request_counts.failed for s in done.values())
    return dg.MaterializeResult(
        metadata={
            "shards_run": len(todo),
            "shards_skipped": manifest.shard_count - len(todo),
            "completed": completed,
            "failed": failed,
            "requests_run": ran_requests,
            "inference_s": round(elapsed, 3),
            "output_tokens_per_s": round(ran_tokens / elapsed, 1) if ran_requests else 0.0,
            "status": str(stopped or ("ran" if todo else "cached")),  # Dagster metadata takes no enum
        }
    )


def inference_step(retry_delay_s: float) -> dg.AssetsDefinition:
    """shard_results, the inference step: retried `retry_delay_s` after a failure (an engine crash), doubling."""
    return dg.asset(
        name="shard_results",
        partitions_def=batches,
        group_name=GROUP,
        kinds={"vllm"},
        deps=[batch_shards],
        op_tags=GPU_STEP_TAGS,
        retry_policy=dg.RetryPolicy(max_retries=INFERENCE_RETRIES, delay=retry_delay_s, backoff=dg.Backoff.EXPONENTIAL),
        description="Inference: each shard run on the engine and committed atomically; committed shards are skipped.",
    )(run_shards)


# As the declarations' default makes it: its key is what the job, the checks and the later steps name.
shard_results = inference_step(default("BATCH_STEP_RETRY_DELAY_S"))


def _eta_observation(context: dg.AssetExecutionContext, eta: RunningEta, done: int) -> dg.AssetObservation:
    """The inference step's own ETA once `done` requests in all have finished: its progress blended with its
    estimate's work at the estimate's rate (features/eta.py RunningEta)."""
    now = time.time()
    left = eta.remaining_s(done, now) or 0.0
    return dg.AssetObservation(asset_key=context.asset_key, partition=context.partition_key, metadata={
        "queue_position": 0, "requests_done": done, "fraction_done": round(done / eta.total, 4),
        "estimated_completion_at": dg.MetadataValue.timestamp(now + left)})


def _preview(output: Path) -> list[dict[str, str]]:
    """The first answers of an output file, for the asset's metadata."""
    preview = []
    with open(output, "rb") as f:
        for raw, _ in zip(f, range(3), strict=False):
            line = orjson.loads(raw)
            body = line["response"]["body"]
            choice = (body.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content", choice.get("text", "")) if choice else ""
            preview.append({"custom_id": line["custom_id"], "answer": text or f"[{body.get('object')}]"})
    return preview


def _manifest(folder: BatchFolder) -> Manifest:
    manifest = folder.manifest()
    if manifest is None:
        raise dg.Failure(f"{folder.batch_id} has no shard manifest: batch_shards has not run.", allow_retries=False)
    return manifest


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"json"},
    deps=[shard_results],
    description="The merged output file and error file, in the OpenAI Batch format.",
)
def batch_output_files(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    folder = storage.folder(context.partition_key)
    manifest = _manifest(folder)
    done = committed_shards(folder.storage, folder.results_prefix)
    missing = [i for i in range(manifest.shard_count) if i not in done]
    stopped = folder.stop_reason() if missing else None
    not_run: Any = []
    ending = stopped_ending(stopped) if stopped else None
    if ending:
        # The requests of shards that never ran still get a line each: nothing is dropped.
        not_run = not_run_lines(folder, missing, ending.code, ending.message)
    with folder.storage.writing(folder.output_key) as out, folder.storage.writing(folder.error_key) as err:
        result = merge(folder.storage, folder.results_prefix, manifest.shard_count, out, err,
                       not_run=not_run, missing_ok=bool(stopped))
        preview = _preview(out)
    folder.write_merged(Merged(status=ending.status if ending else BatchStatus.COMPLETED,
                               request_counts=result.request_counts,
                               usage=result.usage, error_codes=result.error_codes))
    return dg.MaterializeResult(
        metadata={
            "output_file": dg.MetadataValue.path(folder.storage.uri(folder.output_key)),
            "error_file": dg.MetadataValue.path(folder.storage.uri(folder.error_key)),
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
    context: dg.AssetExecutionContext, storage: StorageResource, pipeline: PipelineConfig, vllm: VLLMResource
) -> dg.MaterializeResult:
    folder = storage.folder(context.partition_key)
    manifest = _manifest(folder)
    merged = folder.merged()
    if merged is None:
        raise dg.Failure(f"{folder.batch_id} has no merged files: batch_output_files has not run.",
                         allow_retries=False)
    usage = merged.usage
    prices = pipeline.prices()
    cost = cost_of(usage, manifest.model, prices, folder.completion_window())
    if unpriced := prices.unlisted(manifest.model):  # said where the cost is read, not left as a silent 0
        context.log.warning(f"{unpriced}; add it to {pipeline.prices_file} (BATCH_PRICES_FILE)")
    shards = committed_shards(folder.storage, folder.results_prefix).values()
    inference_s = sum(s.duration_s for s in shards)
    summary = Summary(
        batch_id=folder.batch_id,
        status=merged.status,
        endpoint=manifest.endpoint,
        model=manifest.model,
        request_counts=merged.request_counts,
        usage=usage,
        cost=cost,
        error_codes=merged.error_codes,
        inference_s=round(inference_s, 3),
        output_tokens_per_s=round(usage.output_tokens / inference_s, 1) if inference_s else 0.0,
        # The engine starts its shards paid (in their duration_s; 0 when the engine was running already).
        record=vllm.model_record(manifest.model) | {"engine_start_s": round(sum(s.engine_start_s for s in shards), 3)},
        output_file=folder.storage.uri(folder.output_key),
        error_file=folder.storage.uri(folder.error_key),
        completed_at=_now(),
        # Why a batch its cost cap stopped failed (a cancelled or expired one has no errors.data).
        errors=stopped_ending(stop.reason).errors if merged.status != BatchStatus.COMPLETED
        and (stop := folder.stop()) is not None else [],
    )
    folder.write_summary(summary)
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
            **({"price": f"not in the price table: its [defaults] ({pipeline.prices_file})"} if unpriced else {}),
        }
    )


lifecycle_assets = [batch_input, validated_requests, batch_shards, shard_results, batch_output_files, batch_usage]


def lifecycle(retry_delay_s: float) -> list[dg.AssetsDefinition]:
    """The lifecycle's assets, in data-flow order, the inference step retried after `retry_delay_s`
    (BATCH_STEP_RETRY_DELAY_S, read when the definitions load)."""
    return [inference_step(retry_delay_s) if a is shard_results else a for a in lifecycle_assets]
