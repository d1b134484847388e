"""/v1/messages/batches: Anthropic's Message Batches, as its SDK calls them (`client.messages.batches`).

A Message Batch is a batch like any other: its inline requests become the input file of /v1/messages lines, and
it is created, limited, validated, run, billed and followed as every batch is. Only the objects it shows and its
results file speak Anthropic's format (batchfile/anthropic.py); its errors are shaped by api/anthropic_shape.py.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile import anthropic
from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.batchfile.results import iter_lines
from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import BatchRecord, FileRecord, batches, repo
from batch_dagster.features.quotas import KeyLimits, batch_admission, refuse_early
from batch_dagster.storage import file_location

from .batches import storage_has
from .context import AppContext
from .deps import Context, DbSession, Owner
from .errors import ApiError, invalid, not_found
from .idempotency import Claim, Idempotent, fingerprint, gone
from .schemas import Text


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error under /v1/messages (api/anthropic_shape.py)."""

    type: str = "error"
    error: AnthropicErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError, "description": description}
    for status, description in ((400, "Invalid request: a request, a parameter or the batch's state."),
                                (401, "No API key (`x-api-key` or `Authorization: Bearer`), or not a valid one."),
                                (404, "No such Message Batch (for this key), or its results are not ready or gone."),
                                (413, "The request body is larger than the limit."),
                                (429, "A limit of this key is reached."))}
router = APIRouter(tags=["message batches"], responses=ERRORS)
WINDOW = "24h"  # Anthropic's: a Message Batch that has not ended in 24 hours expires


class CreateMessageBatch(BaseModel):
    """The create body: `requests`, each `{custom_id, params}` (checked in batchfile/anthropic.py, at its place)."""

    model_config = ConfigDict(extra="forbid")
    requests: list[Any]


class MessageBatchCounts(BaseModel):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(BaseModel):
    """Anthropic's Message Batch object."""

    id: str
    type: str = "message_batch"
    processing_status: str
    request_counts: MessageBatchCounts
    ended_at: str | None
    created_at: str
    expires_at: str | None
    archived_at: str | None = None
    cancel_initiated_at: str | None
    results_url: str | None


class MessageBatchList(BaseModel):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(BaseModel):
    id: str
    type: str = "message_batch_deleted"


def _ended_at(row: BatchRecord) -> int | None:
    return row.completed_at or row.failed_at or row.expired_at or row.cancelled_at


def _ended_counts(storage: Storage, row: BatchRecord) -> dict[str, int]:
    """An ended batch's counts in Anthropic's terms, from its folder: how many of its lines never ran, cancelled or
    expired (its merge counted their codes), and, of a batch whose input was refused before anything ran, all its
    requests errored (validation counted them)."""
    folder = BatchFolder(storage, row.id)
    merged = folder.summary() or folder.merged()
    counts = anthropic.request_counts(row.status, row.request_total, row.request_completed, row.request_failed,
                                      dict(merged.error_codes) if merged is not None else {})
    if merged is None and row.request_total == 0 and (validation := folder.validation()) is not None:
        counts["errored"] = validation.total_requests
    return counts


def message_batch(row: BatchRecord, ctx: AppContext, request: Request) -> MessageBatch:
    """The Message Batch object of a batch: its status and counts in Anthropic's terms, its times in RFC 3339."""
    status = anthropic.processing_status(row.status)
    ended = status == anthropic.ENDED
    counts = _ended_counts(ctx.storage, row) if ended else anthropic.request_counts(
        row.status, row.request_total, row.request_completed, row.request_failed, {})
    url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{row.id}/results" if ended else None
    return MessageBatch(id=row.id, processing_status=status, request_counts=MessageBatchCounts(**counts),
                        ended_at=anthropic.rfc3339(_ended_at(row)), created_at=anthropic.rfc3339(row.created_at) or "",
                        expires_at=anthropic.rfc3339(row.expires_at),
                        cancel_initiated_at=anthropic.rfc3339(row.cancelling_at), results_url=url)


def _written(requests: list[Any], directory: str) -> tuple[Path, str | None]:
    """The create's requests as an input file (its path), and the model its first request names."""
    path = Path(directory) / "requests.jsonl"
    model = None
    with open(path, "wb") as out:
        for line in anthropic.input_lines(requests):
            named = line["body"].get("model")
            # As the first line of an uploaded file names it (contract.model_of_head): validation reports the rest.
            if model is None and isinstance(named, str) and 0 < len(named) <= c.MAX_MODEL_CHARS:
                model = named
            out.write(c.jsonl_line(line))
    return path, model


@router.post("/messages/batches", response_model=MessageBatch, responses={409: {
    "model": AnthropicError, "description": "The Idempotency-Key was sent before with another request."}})
def create_message_batch(body: CreateMessageBatch, request: Request, ctx: Context, session: DbSession,
                         once: Idempotent) -> MessageBatch:
    """Accept a Message Batch: its requests become its input file, then it is created as every batch is. With an
    Idempotency-Key, a repeat answers the Message Batch the first request made, as it is now (api/idempotency.py)."""
    route = "POST /v1/messages/batches"
    return once.run(session, route, fingerprint(route, body.model_dump(mode="json")),
                    create=lambda claim: _create(body, request, ctx, session, once.owner, claim),
                    found=lambda batch_id: _made(session, once.owner, batch_id, ctx, request))


def _create(body: CreateMessageBatch, request: Request, ctx: AppContext, session: Session, owner: str,
            claim: Claim) -> MessageBatch:
    limits = KeyLimits.of(session, owner, ctx.config)
    refuse_early(limits, session, owner, batches=1)
    windows = ctx.config.windows
    window = windows.window(WINDOW) if WINDOW in windows.names else windows.default
    batch_id = repo.new_batch_id()
    admission = batch_admission(limits)

    def admit(claiming: Session, row: BatchRecord) -> None:
        claim(claiming, row.id)  # the key first: a repeat that lost the race is not counted against the limits
        admission(claiming, row)

    with tempfile.TemporaryDirectory(prefix="message-batch-") as directory:
        try:
            path, model = _written(body.requests, directory)
        except anthropic.RequestsError as exc:
            raise invalid(str(exc), param=exc.param) from None
        size = os.path.getsize(path)
        refuse_early(limits, session, owner, nbytes=size)
        try:
            # Its File is the folder's copy of the input, as a command-line batch's is.
            source = batches.add_input_file(session, owner=owner, file_id=repo.new_file_id(),
                                            filename="message_batch_requests.jsonl", size=size,
                                            path=BatchFolder(ctx.storage, batch_id).input_key)
            asked = BatchRequest(owner=owner, input_file_id=source.id, endpoint=c.MESSAGES, model=model,
                                 window=window)
            row = batches.create_batch(session, ctx.storage, asked, path, batch_id=batch_id, admit=admit)
            session.commit()
        except BaseException:
            session.rollback()
            ctx.storage.delete_folder(BatchFolder(ctx.storage, batch_id).prefix)
            raise
    ctx.launches.send()
    return message_batch(row, ctx, request)


def _made(session: Session, owner: str, batch_id: str, ctx: AppContext, request: Request) -> MessageBatch:
    row = repo.get_batch(session, owner, batch_id)
    if row is None:
        raise gone("message batch", batch_id)
    return message_batch(row, ctx, request)


def _owned(session: Session, owner: str, batch_id: str) -> BatchRecord:
    """The owner's Message Batch: a batch of another endpoint is not one."""
    row = repo.get_batch(session, owner, batch_id)
    if row is None or row.endpoint != c.MESSAGES:
        raise not_found("Message Batch", batch_id, param="message_batch_id")
    return row


@router.get("/messages/batches/{message_batch_id}", response_model=MessageBatch)
def retrieve_message_batch(message_batch_id: Text, request: Request, ctx: Context, session: DbSession,
                           owner: Owner) -> MessageBatch:
    return message_batch(_owned(session, owner, message_batch_id), ctx, request)


@router.get("/messages/batches", response_model=MessageBatchList)
def list_message_batches(request: Request, ctx: Context, session: DbSession, owner: Owner,
                         before_id: Text | None = None, after_id: Text | None = None,
                         limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> MessageBatchList:
    """Newest first. `after_id`: the page after that batch (older ones); `before_id`: the page before it (newer)."""
    if before_id is not None and after_id is not None:
        raise invalid("Give at most one of before_id and after_id.", param="before_id")
    query = select(BatchRecord).where(BatchRecord.owner == owner, BatchRecord.endpoint == c.MESSAGES)
    cursor = before_id or after_id
    if cursor is not None:
        anchor = session.scalar(select(BatchRecord.pk).where(BatchRecord.owner == owner, BatchRecord.id == cursor,
                                                             BatchRecord.endpoint == c.MESSAGES))
        if anchor is None:
            raise not_found("Message Batch", cursor, param="before_id" if before_id else "after_id")
        query = query.where(BatchRecord.pk > anchor if before_id else BatchRecord.pk < anchor)
    newer = before_id is not None
    rows = list(session.scalars(query.order_by(BatchRecord.pk.asc() if newer else BatchRecord.pk.desc())
                                .limit(limit + 1)))
    has_more, rows = len(rows) > limit, rows[:limit]
    if newer:
        rows.reverse()
    data = [message_batch(row, ctx, request) for row in rows]
    return MessageBatchList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                            last_id=data[-1].id if data else None)


@router.post("/messages/batches/{message_batch_id}/cancel", response_model=MessageBatch)
def cancel_message_batch(message_batch_id: Text, request: Request, ctx: Context, session: DbSession,
                         owner: Owner) -> MessageBatch:
    """Ask the run to stop before its next shard: the requests running finish, the rest end `canceled`."""
    row = _owned(session, owner, message_batch_id)
    if row.status in TERMINAL:
        raise invalid(f"Message Batch {row.id} has ended; only one in progress can be canceled.",
                      param="message_batch_id")
    if row.status != BatchStatus.CANCELLING:
        BatchFolder(ctx.storage, row.id).request_stop(BatchStatus.CANCELLED)  # seen before the status says so
        repo.request_cancel(session, row)
    return message_batch(row, ctx, request)


def _stored(ctx: AppContext, session: Session, owner: str, file_id: str | None) -> tuple[Storage, str] | None:
    """Where an ended batch's output or error file is (None: it has none); a 404 when it expired or was deleted."""
    if file_id is None:
        return None
    row = repo.get_file(session, owner, file_id)
    if row is None or not storage_has(ctx.storage, row.path):
        raise ApiError(404, f"The results of this Message Batch are gone (its file {file_id} expired or was "
                            "deleted).", code="not_found")
    return file_location(ctx.storage, row.path)


def _never_ran(ctx: AppContext, row: BatchRecord) -> Iterator[dict[str, Any]]:
    """The lines of a batch whose input was refused before any request ran (its errors say why: a mixed model, a
    limit): each request errored, as a request refused."""
    why = "; ".join(str(e.get("message")) for e in (row.errors or []) if isinstance(e, dict)) or "The batch failed."
    for line in iter_lines(ctx.storage, BatchFolder(ctx.storage, row.id).input_key):
        yield c.request_error_line(str(line.get("custom_id")), c.BATCH_FAILED, why[:2000])


@router.get("/messages/batches/{message_batch_id}/results", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-jsonl": {}},
                             "description": "One result per request (JSONL), matched by custom_id."}})
def message_batch_results(message_batch_id: Text, ctx: Context, session: DbSession,
                          owner: Owner) -> StreamingResponse:
    """An ended batch's results: one line per request, `succeeded`, `errored`, `canceled` or `expired`, streamed from
    its output and error files."""
    row = _owned(session, owner, message_batch_id)
    if row.status not in TERMINAL:
        raise ApiError(404, f"Message Batch {row.id} is still in progress; its results are ready once it has "
                            "ended (results_url is set then).", code="not_found")
    if row.output_file_id is None and row.error_file_id is None:
        lines: Iterator[dict[str, Any]] = _never_ran(ctx, row)
    else:
        # Both files are found now, so a missing one is a 404 before the stream starts.
        files = [where for f in (row.output_file_id, row.error_file_id)
                 if (where := _stored(ctx, session, owner, f)) is not None]
        lines = (line for storage, key in files for line in iter_lines(storage, key))
    return StreamingResponse(anthropic.results(lines), media_type="application/x-jsonl")


@router.delete("/messages/batches/{message_batch_id}", response_model=DeletedMessageBatch)
def delete_message_batch(message_batch_id: Text, ctx: Context, session: DbSession, owner: Owner) -> DeletedMessageBatch:
    """Delete an ended batch: its row, its folder, and its input, output and error files."""
    row = _owned(session, owner, message_batch_id)
    if row.status not in TERMINAL:
        raise invalid(f"Message Batch {row.id} has not ended: cancel it first, then delete it once it has.",
                      param="message_batch_id")
    file_ids = [f for f in (row.input_file_id, row.output_file_id, row.error_file_id) if f]
    files = list(session.scalars(select(FileRecord).where(FileRecord.owner == owner, FileRecord.id.in_(file_ids))))
    session.delete(row)
    session.commit()
    for file in files:
        repo.delete_file(session, ctx.storage, file)
    ctx.storage.delete_folder(BatchFolder(ctx.storage, row.id).prefix)
    return DeletedMessageBatch(id=row.id)
