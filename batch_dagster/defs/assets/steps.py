"""A batch's steps as functions of its folder: the lifecycle assets (batch.py) run one each, a table batch
(defs/table/) runs them all in its one asset. Both get the same validation, limits, shards, merge and summary; the
inference step is inference.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import orjson
import pyarrow.parquet as pq
from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.columnar import validate_to_parquet, write_shards
from batch_dagster.batchfile.failure import not_run_lines, stopped_ending
from batch_dagster.batchfile.folder import BatchFolder, Manifest, Merged, Summary, Validation
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.batchfile.registry import served
from batch_dagster.batchfile.results import MergeResult, committed_shards, merge
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.usage import cost_of
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.models import ApiKey, BatchRecord
from batch_dagster.defs.resources import PipelineConfig, VLLMResource
from batch_dagster.engine.counting import close_workers
from batch_dagster.features.cost_cap import refuse_over_cap
from batch_dagster.features.estimate import Tally, count_tokens, write_estimate
from batch_dagster.features.scope import TABLE, Owner
from batch_dagster.features.token_limit import refuse_over_limit


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def md_table(rows: list[dict[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_none_")
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]).replace("|", "\\|").replace("\n", " ")[:120] for h in head) + " |")
    return dg.MetadataValue.md("\n".join(lines))


def batch_request(session: Session | None, folder: BatchFolder) -> BatchRequest:
    """What the batch's creator asked: its folder's batch.json (every batch's, a table batch's too). A folder written
    before the request was kept whole there names no owner: its row in the store holds it."""
    request = folder.batch_request() or BatchRequest()
    if not request.owner and session is not None:
        row = session.scalar(select(BatchRecord).where(BatchRecord.id == folder.batch_id))
        if row is not None:
            return row.request
    return request


def batch_owner(session: Session | None, request: BatchRequest) -> Owner:
    """Who the batch belongs to, named as the operator knows it: its API key's name (from the store), else its
    namespace (a table batch's), else nobody known."""
    if request.owner.startswith(TABLE):
        return Owner(request.owner, request.owner.removeprefix(TABLE))
    if request.owner and session is not None:
        key = session.get(ApiKey, request.owner)
        return Owner(request.owner, key.name if key is not None and key.name else request.owner)
    return Owner(request.owner, request.owner)


@dataclass
class Validated:
    """What validation found: its report, the batch's tokens (when counted), its estimate (a valid batch whose tokens
    were counted), how long it took, the input's size, its first rows."""

    report: ValidationReport
    tally: Tally | None
    estimate: dict[str, Any] | None
    elapsed_s: float
    size: int
    head: list[dict[str, Any]]


def validate(folder: BatchFolder, pipeline: PipelineConfig, vllm: VLLMResource, session: Session | None, log: Any,
             count: bool = False) -> Validated:
    """Validate the folder's input into its requests file (published only when valid), count its tokens once, refuse
    it past its owner's token limit or its cost cap, write the validation report, and give a valid batch its
    estimate.

    The tokens are counted when something reads them: a limit, a store (the estimate's queue and rate), a max_cost,
    or `count` (a table batch's estimate). Without any (a CLI run with no store) nothing does."""
    started = time.perf_counter()
    size = folder.storage.size(folder.input_key) or 0
    # The input is validated as it streams in; the requests file is published only when the file is valid.
    with folder.storage.open(folder.input_key) as source, folder.storage.writing(folder.requests_key) as out:
        report = validate_to_parquet(source, out, size=size, limits=pipeline.limits, endpoint=folder.endpoint(),
                                     models=served(vllm.registry(), pipeline.image_sources))
        elapsed = time.perf_counter() - started
        # The one count of its tokens: a limit that must hold fails the step when the tokenizer fails.
        limit, budget = pipeline.max_enqueued_tokens, pipeline.key_daily_budget
        options = batch_request(session, folder).options
        # A batch cancelled (or expired) before its run started runs nothing: its requests are only listed.
        stopped = folder.stop_reason() is not None
        wanted = (limit or session is not None or options.max_cost is not None or count) and not stopped
        servers = vllm.server_urls_for(report.model) if report.model is not None else None
        tally = count_tokens(out, report, vllm.models, needed=bool(limit or budget), log=log, servers=servers,
                             api_key=vllm.server_api_key) if wanted else None
        # The model's engine starts in this process next: its count worker's memory (vLLM's renderer, torch) goes
        # back first. Beside an engine already running (a process's second batch) it stays, for the next count.
        if wanted and report.model is not None and vllm.engine_starts_here(report.model):
            close_workers()
        prompt_tokens = refuse_over_limit(session, folder, report, limit, tally)
        if not stopped:
            refuse_over_cap(session, folder.batch_id, options, report, tally, pipeline.prices(), budget,
                            folder.completion_window())
        head = (pq.ParquetFile(out).read_row_group(0, columns=["custom_id", "prompt_chars", "body"]).slice(0, 5)
                .to_pylist() if report.valid else [])
        if not report.valid:
            out.unlink(missing_ok=True)  # over the token limit or the cost cap: valid rows, but the batch is refused
    folder.write_validation(Validation(
        valid=report.valid, total_requests=report.total_requests, model=report.shown_model, endpoint=report.endpoint,
        error_count=report.error_count, errors=report.listed_errors, validated_at=now(), prompt_tokens=prompt_tokens))
    estimate = _estimate(session, folder, report, tally, pipeline, log) if report.valid else None
    return Validated(report, tally, estimate, elapsed, size, head)


def _estimate(session: Session | None, folder: BatchFolder, report: ValidationReport, tally: Tally | None,
              pipeline: PipelineConfig, log: Any) -> dict[str, Any] | None:
    """The valid batch's estimate (features/estimate.py write_estimate), or None: without a tally (nothing asked for
    its tokens), or when the store fails (logged): the batch is valid and runs; it shows no estimate."""
    if (made := folder.estimate()) is not None:
        return made
    if tally is None:
        return None
    try:
        return write_estimate(session, folder, report, tally, pipeline.prices(), pipeline.estimate_tokens_per_s)
    except Exception as exc:  # the store unreachable
        log.warning(f"No estimate for this batch: {str(exc)[:500]}")
        return None


def estimate_metadata(estimate: dict[str, Any] | None) -> dict[str, Any]:
    """The estimate as a materialization shows it."""
    if not estimate or not estimate.get("valid"):
        return {}
    duration, cost = estimate.get("duration_s") or {}, estimate.get("cost") or {}
    return {"estimated_input_tokens": estimate["input_tokens"], "estimated_max_output_tokens":
            estimate["max_output_tokens"], **({"estimated_duration_s_max": duration["max"]} if duration else {}),
            **({"estimated_cost_max": cost["max"]} if cost else {})}


def plan_shards(folder: BatchFolder, pipeline: PipelineConfig, log: Any) -> tuple[Manifest, bool]:
    """The batch's shards, cut once: (the manifest, whether it was planned before). Results may already be committed
    against a plan, so it is never cut again."""
    manifest = folder.manifest()
    if manifest is not None:
        log.info(f"Reusing the {manifest.shard_count} shards already planned")
        return manifest, True
    validation = folder.validation()
    assert validation is not None and validation.model and validation.endpoint  # validation ran
    shard_size = pipeline.shard_size
    with folder.storage.local_copy(folder.requests_key) as requests, \
            folder.storage.writing_folder(folder.shards_prefix) as shards:
        sizes = write_shards(requests, shards, shard_size)
    # The manifest is written last: it is what marks the shards as planned and complete.
    manifest = Manifest(batch_id=folder.batch_id, endpoint=validation.endpoint, model=validation.model,
                        total_requests=sum(sizes), shard_size=shard_size, shard_count=len(sizes), shard_sizes=sizes)
    folder.write_manifest(manifest)
    log.info(f"{sum(sizes)} requests in {len(sizes)} shards of up to {shard_size}")
    return manifest, False


def manifest_of(folder: BatchFolder) -> Manifest:
    manifest = folder.manifest()
    if manifest is None:
        raise dg.Failure(f"{folder.batch_id} has no shard manifest: batch_shards has not run.", allow_retries=False)
    return manifest


def preview(output: Path) -> list[dict[str, str]]:
    """The first answers of an output file, for the asset's metadata."""
    shown = []
    with open(output, "rb") as f:
        for raw, _ in zip(f, range(3), strict=False):
            line = orjson.loads(raw)
            body = line["response"]["body"]
            choice = (body.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content", choice.get("text", "")) if choice else ""
            shown.append({"custom_id": line["custom_id"], "answer": text or f"[{body.get('object')}]"})
    return shown


def merge_results(folder: BatchFolder) -> tuple[MergeResult, list[dict[str, str]]]:
    """The output and error files, merged whole from the committed shards (and, for a batch stopped early, a line
    for each request of the shards that never ran: nothing is dropped); the totals and the first answers."""
    manifest = manifest_of(folder)
    done = committed_shards(folder.storage, folder.results_prefix)
    missing = [i for i in range(manifest.shard_count) if i not in done]
    stopped = folder.stop_reason() if missing else None
    not_run: Any = []
    ending = stopped_ending(stopped) if stopped else None
    if ending:
        not_run = not_run_lines(folder, missing, ending.code, ending.message)
    with folder.storage.writing(folder.output_key) as out, folder.storage.writing(folder.error_key) as err:
        result = merge(folder.storage, folder.results_prefix, manifest.shard_count, out, err,
                       not_run=not_run, missing_ok=bool(stopped))
        shown = preview(out)
    folder.write_merged(Merged(status=ending.status if ending else BatchStatus.COMPLETED,
                               request_counts=result.request_counts, usage=result.usage,
                               error_codes=result.error_codes, reused=result.reused))
    return result, shown


def summarize(folder: BatchFolder, pipeline: PipelineConfig, vllm: VLLMResource, log: Any) -> Summary:
    """The batch's summary (usage, cost, how it ran), written last."""
    manifest = manifest_of(folder)
    merged = folder.merged()
    if merged is None:
        raise dg.Failure(f"{folder.batch_id} has no merged files: batch_output_files has not run.",
                         allow_retries=False)
    usage = merged.usage
    prices = pipeline.prices()
    cost = cost_of(usage, manifest.model, prices, folder.completion_window())
    if unpriced := prices.unlisted(manifest.model):  # said where the cost is read, not left as a silent 0
        log.warning(f"{unpriced}; add it to {pipeline.prices_file} (BATCH_PRICES_FILE)")
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
        completed_at=now(),
        # Why a batch its cost cap stopped failed (a cancelled or expired one has no errors.data).
        errors=stopped_ending(stop.reason).errors if merged.status != BatchStatus.COMPLETED
        and (stop := folder.stop()) is not None else [],
        reused=merged.reused,
    )
    folder.write_summary(summary)
    return summary
