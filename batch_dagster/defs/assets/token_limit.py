"""The enqueued-token limit as validation applies it: count the batch's prompt tokens, refuse it past the limit."""

from __future__ import annotations

from pathlib import Path

from batch_dagster.batchfile.columnar import read_shard
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.session import open_database
from batch_dagster.db.token_limit import enqueued_tokens, limit_error
from batch_dagster.defs.resources import PipelineConfig, VLLMResource
from batch_dagster.engine.tokens import prompt_tokens


def apply_token_limit(folder: BatchFolder, requests: Path, report: ValidationReport, pipeline: PipelineConfig,
                      vllm: VLLMResource) -> int | None:
    """The valid batch's prompt tokens (its validated `requests` file) when a limit is set (else None); over the
    limit, an error in `report`.

    The limit is per owner and model: this batch plus the owner's unfinished batches for the same
    model, as their validation documents recorded them.
    """
    limit = pipeline.max_enqueued_tokens
    if not limit or not report.valid or report.model is None or report.endpoint is None:
        return None
    tokenizer = vllm.tokenizer(report.model)
    tokens = sum(prompt_tokens(tokenizer, report.endpoint, body) for _, body in read_shard(requests))
    enqueued = 0
    if pipeline.store_url:
        with open_database(pipeline.store_url).session() as session:
            _, enqueued = enqueued_tokens(session, folder.storage, folder.batch_id, report.model)
    if tokens + enqueued > limit:
        report.errors.append(limit_error(report.model, limit, tokens, enqueued))
        report.error_count += 1
    return tokens
