"""/v1/batches/estimate: what a batch of an uploaded file would cost and take, before it is created.

An extension (OpenAI has none): the create body, answered with a `batch.estimate` object; nothing is written.
The model's tokenizer (transformers) is loaded on the first estimate for that model, never at import.
"""

from __future__ import annotations

from fastapi import APIRouter

from batch_dagster.batchfile.estimate import estimate_stream
from batch_dagster.batchfile.registry import served
from batch_dagster.batchfile.usage import load_price_table
from batch_dagster.db.estimate import measured_throughput, queue_ahead
from batch_dagster.engine.models import Models
from batch_dagster.storage import file_location

from .batches import checked_source
from .deps import Context, DbSession, Owner
from .errors import ERROR_RESPONSES
from .schemas import BatchEstimate, CreateBatchRequest

router = APIRouter(tags=["batches"], responses=ERROR_RESPONSES)


@router.post("/batches/estimate", response_model=BatchEstimate)
def estimate_batch(body: CreateBatchRequest, ctx: Context, session: DbSession, owner: Owner) -> BatchEstimate:
    """Validate the caller's file as the batch would, count its tokens with the model's tokenizer, price it and
    time it against the model's measured throughput and queue. The same checks as create, the same 404s."""
    source = checked_source(body, ctx, session, owner)
    path, size = source.path, source.bytes
    session.rollback()  # no transaction stays open while the file is tokenized (the store is asked again after)
    config, models = ctx.config, Models.from_settings(ctx.config)
    files, key = file_location(ctx.storage, path)
    with files.open(key) as f:
        estimate = estimate_stream(
            f, size=size, limits=config.limits, endpoint=body.endpoint,
            served=served(models.registry(), config.image_sources), counter=models.counter,
            prices=load_price_table(config.prices_file),
            throughput=lambda model: measured_throughput(session, ctx.storage, model, config.estimate_tokens_per_s),
            queue=lambda model: queue_ahead(session, model))
    return BatchEstimate.model_validate(estimate.to_dict())
