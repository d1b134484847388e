"""Validation's one count of a valid batch's tokens (the token limit, the cost cap and the estimate all read it), and
the enqueued-token limit: refuse a batch past it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batch_dagster.batchfile.columnar import read_shard
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.session import open_database
from batch_dagster.defs.resources import PipelineConfig, VLLMResource
from batch_dagster.features.estimate import Tally
from batch_dagster.features.token_limit import enqueued_tokens, limit_error


def count_tokens(requests: Path, report: ValidationReport, pipeline: PipelineConfig, vllm: VLLMResource,
                 log: Any) -> Tally | None:
    """The valid batch's tokens, its validated `requests` counted once with the model's tokenizer (each request's
    prompt and bound on output, as the estimate counts them); None for an invalid batch, or when nothing reads them
    (no token limit and no store: a CLI run has no queue, no key and no cap).

    A tokenizer that fails fails the step where a limit must hold (the token limit, a key's daily budget; a batch's
    max_cost fails it in apply_cost_cap); else it is logged and the batch runs without an estimate.
    """
    if not report.valid or report.model is None or report.endpoint is None:
        return None
    if not pipeline.max_enqueued_tokens and not pipeline.store_url:
        return None
    try:
        count, context_length = vllm.models.counter(report.model)
        tally = Tally()
        for _, body in read_shard(requests):
            tally.add(report.endpoint, body, count, context_length)
    except Exception as exc:
        if pipeline.max_enqueued_tokens or pipeline.key_daily_budget:
            raise
        log.warning(f"The batch's tokens could not be counted, so it has no estimate: {str(exc)[:500]}")
        return None
    return tally


def apply_token_limit(folder: BatchFolder, report: ValidationReport, pipeline: PipelineConfig,
                      tally: Tally | None) -> int | None:
    """The valid batch's prompt tokens (from its `tally`) when a limit is set (else None); over the limit, an error
    in `report`.

    The limit is per owner and model: this batch plus the owner's unfinished batches for the same
    model, as their validation documents recorded them.
    """
    limit = pipeline.max_enqueued_tokens
    if not limit or tally is None or report.model is None:
        return None
    tokens = tally.input_tokens
    enqueued = 0
    if pipeline.store_url:
        with open_database(pipeline.store_url).session() as session:
            _, enqueued = enqueued_tokens(session, folder.storage, folder.batch_id, report.model)
    if tokens + enqueued > limit:
        report.errors.append(limit_error(report.model, limit, tokens, enqueued))
        report.error_count += 1
    return tokens
