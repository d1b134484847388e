"""The per-model enqueued-token limit (BATCH_MAX_ENQUEUED_TOKENS): prompt tokens an owner has waiting or running for
one model; validation refuses a batch that would take its owner past it (`refuse_over_limit`)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.models import BatchRecord

from .estimate import Tally


def enqueued_tokens(session: Session, storage: Storage, batch_id: str, model: str) -> tuple[str | None, int]:
    """(owner of `batch_id`, prompt tokens of that owner's other unfinished batches for `model`).

    Each validated batch's count is in its validation document, so this reads no request.
    """
    owner = session.scalar(select(BatchRecord.owner).where(BatchRecord.id == batch_id))
    if owner is None:
        return None, 0
    others = session.scalars(select(BatchRecord.id).where(
        BatchRecord.owner == owner, BatchRecord.id != batch_id, BatchRecord.status.not_in(TERMINAL)))
    total = 0
    for other in others:
        validation = BatchFolder(storage, other).validation()
        if validation is not None and validation.valid and validation.model == model:
            total += validation.prompt_tokens or 0
    return owner, total


def limit_error(model: str, limit: int, tokens: int, enqueued: int) -> c.BatchError:
    """The batch error for a batch that would take its owner past the limit (OpenAI's code)."""
    return c.BatchError(
        c.TOKEN_LIMIT_EXCEEDED,
        f"Enqueued token limit reached for {model}. Limit: {limit:,} enqueued tokens; this batch has {tokens:,} "
        f"prompt tokens and {enqueued:,} are already enqueued. Please try submitting your batch again once some "
        "in_progress batches have been completed.",
    )


def refuse_over_limit(session: Session | None, folder: BatchFolder, report: ValidationReport, limit: int | None,
                      tally: Tally | None) -> int | None:
    """The valid batch's prompt tokens (from its `tally`) when a limit is set (else None); over the limit, an error
    in `report`. The limit is per owner and model: this batch plus the owner's unfinished batches for the same model
    in the store (`session`; None: no store, this batch alone), as their validation documents recorded them."""
    if not limit or tally is None or report.model is None:
        return None
    tokens = tally.input_tokens
    enqueued = 0 if session is None else enqueued_tokens(session, folder.storage, folder.batch_id, report.model)[1]
    if tokens + enqueued > limit:
        report.errors.append(limit_error(report.model, limit, tokens, enqueued))
        report.error_count += 1
    return tokens
