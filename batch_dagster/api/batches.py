"""/v1/batches: create a batch from an uploaded file (or estimate one), follow it, list, cancel, retry."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import QueryParams

from batch_dagster.batchfile.contract import COUNT_TIMEOUT, ENDPOINTS
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.options import MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE, BatchRequest
from batch_dagster.batchfile.results import committed_output
from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.windows import NO_WINDOW, Window
from batch_dagster.db import BatchRecord, FileRecord, batches, repo
from batch_dagster.db.keys import limits_of
from batch_dagster.engine.models import Models
from batch_dagster.engine.tokens import CountFailed, CountTimeout
from batch_dagster.features.estimate import Counted, Estimate, count_file, price_file, unreachable_deadline
from batch_dagster.features.eta import meets_deadline
from batch_dagster.features.quotas import KeyLimits, batch_admission, refuse_early
from batch_dagster.features.retry import RESERVED_METADATA, CannotRetry, create_retry
from batch_dagster.storage import file_location

from .context import AppContext
from .deps import Context, DbSession, Owner
from .errors import ERROR_RESPONSES, IDEMPOTENT_RESPONSES, ApiError, clip, invalid, not_found
from .idempotency import Claim, Idempotent, fingerprint, gone
from .schemas import (
    MAX_UNIX_S,
    Batch,
    BatchError,
    BatchErrors,
    BatchEstimate,
    BatchRequestCounts,
    BatchUsage,
    CreateBatchRequest,
    ListPage,
    RetryRequest,
    Text,
    shown,
)

router = APIRouter(tags=["batches"], responses=ERROR_RESPONSES)
log = logging.getLogger("batch_dagster.api")


def batch_object(row: BatchRecord) -> Batch:
    """The Batch object: what its creator asked (its BatchRequest), and how far it is."""
    stored = row.errors if isinstance(row.errors, list) else []
    errors = BatchErrors(data=[_shown_error(e) for e in stored if isinstance(e, dict)]) if stored else None
    return Batch(
        id=row.id, status=row.status, **_asked(row.request), **row.times(), errors=errors,
        output_file_id=row.output_file_id, error_file_id=row.error_file_id,
        request_counts=BatchRequestCounts(**row.counts().to_dict()), usage=_shown_usage(row.usage),
        **_queue_place(row),
    )


def _asked(request: BatchRequest) -> dict[str, Any]:
    """A BatchRequest's fields of the Batch object."""
    return {"endpoint": request.endpoint, "input_file_id": request.input_file_id, "model": request.model,
            "completion_window": request.completion_window or NO_WINDOW,
            "metadata": _shown_metadata(request.metadata), **request.options.model_dump()}


def _queue_place(row: BatchRecord) -> dict[str, Any]:
    """Queue position and ETA as the daemon's queue_eta_sensor stored them (null once the batch has ended), and the
    estimate validation made."""
    ended = row.status in TERMINAL
    try:
        estimate = BatchEstimate.model_validate(row.estimate) if row.estimate is not None else None
    except ValidationError:
        log.warning("Stored estimate that is not an estimate object: %.200r", row.estimate)
        estimate = None
    return {"queue_position": None if ended else row.queue_position,
            "estimated_completion_at": None if ended else row.estimated_completion_at,
            "meets_deadline": None if ended else meets_deadline(row.estimated_completion_at, row.expires_at),
            "deadline_at_risk_at": row.deadline_at_risk_at, "estimate": estimate}


def _shown_metadata(meta: object) -> dict[str, str] | None:
    """Stored metadata as strings: whatever a row holds (a value from before validation, another writer's),
    listing it never fails."""
    if not isinstance(meta, dict):
        return None
    return {shown(k): shown(v) for k, v in meta.items()}


def _shown_error(error: dict) -> BatchError:
    def text(name: str) -> str | None:
        return None if error.get(name) is None else shown(error[name])

    line = error.get("line")
    return BatchError(code=text("code"), message=text("message"), param=text("param"),
                      line=line if isinstance(line, int) else None)


def _shown_usage(usage: object) -> BatchUsage:
    try:
        return BatchUsage.model_validate(usage or {})
    except ValidationError:
        log.warning("Stored usage that is not a usage object: %.200r", usage)
        return BatchUsage()


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """A create's metadata: bounded (_bound_metadata), and no key the service sets itself."""
    for key in RESERVED_METADATA:
        if key in (metadata or {}):
            raise invalid(f"metadata key {key!r} is reserved: the retry endpoint (POST /v1/batches/{{batch_id}}/retry) "
                          "sets it on the batches it creates.", "metadata", code="reserved_metadata_key")
    _bound_metadata(metadata)


def _bound_metadata(metadata: dict[str, str] | None) -> None:
    """Metadata (a create's, or a list's filter) within OpenAI's bounds, and storable on every database: no NUL,
    which PostgreSQL's text and JSON refuse."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid(f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.", "metadata")
    if any("\x00" in key or "\x00" in value for key, value in metadata.items()):
        raise invalid("metadata keys and values must not contain NUL characters.", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid(f"metadata key {clip(key, 20)!r} is longer than {MAX_METADATA_KEY} characters.",
                          "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise invalid(f"metadata value of {clip(key, 20)!r} is longer than {MAX_METADATA_VALUE} characters.",
                          "metadata")


@router.post("/batches", response_model=Batch, responses=IDEMPOTENT_RESPONSES)
def create_batch(body: CreateBatchRequest, ctx: Context, session: DbSession, owner: Owner, once: Idempotent) -> Batch:
    """Accept a batch: its input goes into the pipeline's storage; the Dagster sensor launches it.

    Everything is checked before the first write, and a write that fails takes the batch's folder with it,
    so a create either succeeds or leaves nothing behind. With an Idempotency-Key, a repeat answers the batch the
    first request made, as it is now (api/idempotency.py).
    """
    route = "POST /v1/batches"
    return once.run(session, route, fingerprint(route, body.model_dump(mode="json")),
                    create=lambda claim: _create_batch(body, ctx, session, owner, claim),
                    found=lambda batch_id: _made_batch(session, owner, batch_id))


def _create_batch(body: CreateBatchRequest, ctx: AppContext, session: Session, owner: str, claim: Claim) -> Batch:
    source = checked_source(body, ctx, session, owner)
    limits = KeyLimits.of(session, owner, ctx.config)
    refuse_early(limits, session, owner, batches=1, nbytes=source.bytes)  # its folder keeps a copy of the input
    batch_id, window = repo.new_batch_id(), ctx.config.windows.window(body.completion_window)
    admission = batch_admission(limits)

    def admit(claiming: Session, row: BatchRecord) -> None:
        claim(claiming, row.id)  # the key first: a repeat that lost the race is not counted against the limits
        admission(claiming, row)

    try:
        # Counted again by `admit`, with the owner locked, once the input is copied.
        row = batches.create_batch(session, ctx.storage, body.asked(owner, window), source, batch_id=batch_id,
                                   admit=admit)
        # The model is the file's first request's, which creating the batch read.
        if refusal := unreachable_deadline(session, row.model, source.bytes, window):
            raise invalid(refusal, param="completion_window", code="deadline_unreachable")
        session.commit()
    except BaseException:
        session.rollback()
        _remove_folder(ctx.storage, batch_id)
        raise
    ctx.launches.send()
    return batch_object(row)


def _made_batch(session: Session, owner: str, batch_id: str) -> Batch:
    row = repo.get_batch(session, owner, batch_id)
    if row is None:
        raise gone("batch", batch_id)
    return batch_object(row)


@router.post("/batches/estimate", response_model=BatchEstimate)
async def estimate_batch(body: CreateBatchRequest, ctx: Context, owner: Owner) -> BatchEstimate:
    """Extension: what a batch of the caller's file would cost and take, before it is created; nothing is written.

    The file is validated as the batch would be, its tokens counted as the engine counts them (each body rendered by
    vLLM in the API's count worker, started on the first estimate, never at import: engine/counting.py), priced and
    timed against the model's measured throughput and queue. The same checks as create, the same 404s. The count
    runs on the estimate lane (api/lanes.py), never in the API's worker pool, one file of a key at a time, and is kept
    by file: a File's bytes never change. It stops at BATCH_ESTIMATE_TIMEOUT_S, or at a body that renders past vLLM's
    own bound (its worker killed): a 400 `count_timeout` naming the line.
    """
    async with ctx.estimates.admitted(owner):
        file_id, path, size = await run_in_threadpool(_estimated_file, body, ctx, owner)
        kept = (file_id, body.endpoint)
        counted = ctx.counts.get(kept)
        if counted is None:
            try:
                counted = await ctx.estimates.run(owner, lambda: ctx.counts.get(kept) or _count(ctx, kept, path, size))
            except CountTimeout as exc:
                raise invalid(str(exc), code=COUNT_TIMEOUT) from None
            except CountFailed as exc:
                raise ApiError(503, f"The tokens could not be counted: {exc}", type="server_error",
                               code="count_failed") from None
        estimate = await run_in_threadpool(_priced, ctx, counted, ctx.config.windows.window(body.completion_window))
    if refusal := estimate.deadline_refusal():
        raise invalid(refusal, param="completion_window", code="deadline_unreachable")
    return BatchEstimate.model_validate(estimate.to_dict())


def _estimated_file(body: CreateBatchRequest, ctx: AppContext, owner: str) -> tuple[str, str, int]:
    with ctx.db.session() as session:
        source = checked_source(body, ctx, session, owner)
        return source.id, source.path, source.bytes


def _count(ctx: AppContext, kept: tuple[str, str], path: str, size: int) -> Counted:
    files, key = file_location(ctx.storage, path)
    with files.open(key) as f:
        counted = count_file(f, size=size, endpoint=kept[1], models=Models.from_settings(ctx.config),
                             settings=ctx.config)
    ctx.counts.put(kept, counted)
    return counted


def _priced(ctx: AppContext, counted: Counted, window: Window) -> Estimate:
    with ctx.db.session() as session:
        return price_file(counted, session=session, storage=ctx.storage, settings=ctx.config, window=window)


def checked_source(body: CreateBatchRequest, ctx: Context, session: Session, owner: str) -> FileRecord:
    """The caller's input File of a create body, every field checked: create and estimate refuse the same."""
    if refusal := ctx.config.windows.refusal(body.completion_window):
        code, message = refusal
        raise invalid(message, param="completion_window", code=code)
    if body.endpoint not in ENDPOINTS:
        raise invalid(f"Endpoint {clip(body.endpoint, 40)!r} is not supported; use one of {', '.join(ENDPOINTS)}.",
                      param="endpoint", code="invalid_endpoint")
    _check_metadata(body.metadata)
    highest = limits_of(session, owner, ctx.config).max_priority
    if highest is not None and body.priority > highest:
        raise invalid(f"priority {body.priority} is above {highest}, the highest this key may ask (its own, or "
                      "else BATCH_KEY_MAX_PRIORITY).", param="priority", code="priority_not_allowed")
    refuse_early(KeyLimits.of(session, owner, ctx.config), session, owner, batches=1)
    source = repo.get_file(session, owner, body.input_file_id)
    if source is None:
        raise not_found("File", body.input_file_id, param="input_file_id")
    if source.purpose != "batch":
        raise invalid(f"File {source.id} has purpose {source.purpose!r}; a batch needs a file uploaded with "
                      "purpose 'batch'.", param="input_file_id", code="invalid_input_file")
    if not storage_has(ctx.storage, source.path):
        raise ApiError(404, f"The content of file {source.id} is gone.", param="input_file_id", code="not_found")
    return source


def storage_has(storage: Storage, path: str) -> bool:
    files, key = file_location(storage, path)
    return files.exists(key)


def _remove_folder(storage: Storage, batch_id: str) -> None:
    """Take away what a failed create wrote, so that no sensor ever sees a folder without its row."""
    storage.delete_folder(BatchFolder(storage, batch_id).prefix)


def _owned_batch(session, owner: str, batch_id: str) -> BatchRecord:
    """The batch as stored: its status is what the status sensor (or the CLI's run) last wrote from its files,
    so a read lists no shard and reads no document of the batch's folder."""
    row = repo.get_batch(session, owner, batch_id)
    if row is None:
        raise not_found("Batch", batch_id, param="batch_id")
    return row


@router.get("/batches/{batch_id}", response_model=Batch)
def retrieve_batch(batch_id: Text, session: DbSession, owner: Owner) -> Batch:
    return batch_object(_owned_batch(session, owner, batch_id))


@router.post("/batches/{batch_id}/retry", response_model=Batch)
def retry_batch(batch_id: Text, ctx: Context, session: DbSession, owner: Owner, body: RetryRequest | None = None
                ) -> Batch:
    """Extension: create a batch of the failures that were not the requests' own, or (`only`) of the lines whose
    structured answer does not follow its schema (features/retry.py); its metadata names the parent. It keeps the
    parent's options, its priority no higher than the key may ask now."""
    parent = _owned_batch(session, owner, batch_id)
    limits = KeyLimits.of(session, owner, ctx.config)
    refuse_early(limits, session, owner, batches=1)
    try:
        child = create_retry(session, ctx.storage, parent, windows=ctx.config.windows, admit=batch_admission(limits),
                             max_priority=limits_of(session, owner, ctx.config).max_priority,
                             only=(body or RetryRequest()).only)
    except CannotRetry as exc:
        raise invalid(str(exc), param="batch_id", code="nothing_to_retry") from exc
    ctx.launches.send()
    return batch_object(child)


def _metadata_filter(query: QueryParams) -> dict[str, str]:
    """The `metadata[KEY]=VALUE` pairs of a list's query, bounded as a batch's metadata is."""
    pairs = {key[len("metadata["):-1]: value for key, value in query.multi_items()
             if key.startswith("metadata[") and key.endswith("]")}
    try:
        _bound_metadata(pairs)  # a reserved key is a filter like any other: retries are found by their parent
    except ApiError as e:
        raise invalid(f"The metadata filter: {e.message}", "metadata") from None
    return pairs


@router.get("/batches", response_model=ListPage[Batch])
def list_batches(
    request: Request,
    session: DbSession,
    owner: Owner,
    after: Text | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: BatchStatus | None = None,
    created_after: Annotated[int | None, Query(ge=0, le=MAX_UNIX_S, description="unix seconds, inclusive")] = None,
    created_before: Annotated[int | None, Query(ge=0, le=MAX_UNIX_S, description="unix seconds, exclusive")] = None,
) -> ListPage[Batch]:
    """Newest first, `after` paging over the filtered list. Extensions to OpenAI's list: `status`,
    `metadata[KEY]=VALUE` (any number, all must match), `created_after` and `created_before`."""
    where = repo.BatchFilter(status=status, metadata=_metadata_filter(request.query_params),
                             created_after=created_after, created_before=created_before)
    page = repo.list_batches(session, owner, after=after, limit=limit, where=where)
    if page is None:  # only when `after` names no batch
        raise not_found("Batch", str(after), param="after")
    rows, has_more = page
    data = [batch_object(r) for r in rows]
    return ListPage[Batch].of(data, has_more)


@router.get("/batches/{batch_id}/partial_output", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}},
                             "description": "The output lines of the shards committed so far (JSONL)."}})
def partial_output(batch_id: Text, ctx: Context, session: DbSession, owner: Owner) -> StreamingResponse:
    """Extension: while the batch runs (and after), the output lines of its committed shards, each custom_id
    once: the lines its output file holds of them. Empty before the first shard commits."""
    row = _owned_batch(session, owner, batch_id)
    lines = committed_output(ctx.storage, BatchFolder(ctx.storage, row.id).results_prefix)
    return StreamingResponse(lines, media_type="application/jsonl")


@router.post("/batches/{batch_id}/cancel", response_model=Batch)
def cancel_batch(batch_id: Text, ctx: Context, session: DbSession, owner: Owner) -> Batch:
    """Ask the run to stop before its next shard; the batch is `cancelling` until it has."""
    row = _owned_batch(session, owner, batch_id)
    if row.status in TERMINAL:
        raise invalid(f"Batch {clip(batch_id)} is {row.status}; only a batch that has not ended can be cancelled.",
                      param="batch_id", code="batch_not_cancellable")
    if row.status != BatchStatus.CANCELLING:
        # The stop file first: once the status says cancelling, the pipeline must already see it.
        BatchFolder(ctx.storage, batch_id).request_stop(BatchStatus.CANCELLED)
        repo.request_cancel(session, row)
    return batch_object(row)
