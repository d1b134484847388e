"""POST /v1/batches/{batch_id}/retry (an extension): a child batch of the batch's retryable failed requests."""

from __future__ import annotations

from fastapi import APIRouter

from batch_dagster.db import repo
from batch_dagster.features.retry import CannotRetry, create_retry

from .batches import batch_object
from .deps import Context, DbSession, Owner
from .errors import ERROR_RESPONSES, invalid, not_found
from .quotas import check_batches
from .schemas import Batch, Text

router = APIRouter(tags=["batches"], responses=ERROR_RESPONSES)


@router.post("/batches/{batch_id}/retry", response_model=Batch)
def retry_batch(batch_id: Text, ctx: Context, session: DbSession, owner: Owner) -> Batch:
    """Create a batch of the failures that were not the requests' own; its metadata names the parent."""
    parent = repo.get_batch(session, owner, batch_id)
    if parent is None:
        raise not_found("Batch", batch_id, param="batch_id")
    check_batches(ctx.config, session, owner)
    try:
        child = create_retry(session, ctx.storage, parent, completion_window_s=ctx.config.completion_window_s)
    except CannotRetry as exc:
        raise invalid(str(exc), param="batch_id", code="nothing_to_retry") from exc
    return batch_object(child)
