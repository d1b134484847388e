"""A batch whose run failed for good keeps what it finished: the committed shards' lines, and an error line for
every other request, so each custom_id is in the output or the error file exactly once and a retry runs again
exactly those that never ran. It ends the way a cancel ends, with its own code (`batch_failed`); `stopped_ending`
says how a batch asked to stop (cancel, expiry, its cost cap, the error-rate breaker) ends, and `is_retryable` which
error lines a retry runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, NamedTuple

import orjson

from . import contract as c
from .columnar import custom_ids
from .folder import BatchFolder, Merged, Summary
from .results import CommittedShard, committed_shards, merge
from .status import BatchStatus
from .usage import PriceTable, cost_of

# How much of the run's failure each error line repeats (the batch's errors.data holds a longer part).
LINE_REASON_CHARS = 200
ERROR_REASON_CHARS = 2000
NOT_RUN_CODES = {BatchStatus.CANCELLED: c.BATCH_CANCELLED, BatchStatus.EXPIRED: c.BATCH_EXPIRED}
# Stop.reason of a batch its cost cap, or its error-rate breaker, stopped (beside "cancelled" and "expired"); its
# error lines carry the same code.
COST_LIMIT = c.COST_LIMIT_EXCEEDED
ERROR_RATE = c.ERROR_RATE_EXCEEDED
STOP_REASONS = (BatchStatus.CANCELLED, BatchStatus.EXPIRED, COST_LIMIT, ERROR_RATE)  # Stop.reason's values
# A request's line when the cost cap stopped its batch before it ran, and the batch's errors.data.
COST_LIMIT_NOT_RUN = "The batch reached its cost limit (max_cost or the key's daily budget) before this request ran."
COST_LIMIT_ERROR = c.BatchError(c.COST_LIMIT_EXCEEDED, "The batch reached its cost limit (max_cost or the key's daily "
                                                       "budget); the requests it had not run are in the error file.")


# A request's line when the error-rate breaker stopped its batch before it ran, and the batch's errors.data.
ERROR_RATE_NOT_RUN = ("The batch stopped before this request ran: nearly all of its first requests failed (the "
                      "error-rate breaker); fix what its error file says and send the batch again.")
ERROR_RATE_ERROR = c.BatchError(c.ERROR_RATE_EXCEEDED, "Nearly all of the batch's first requests failed, past the "
                                "error-rate breaker (error_breaker_rate, else BATCH_ERROR_BREAKER_RATE, among the "
                                "first BATCH_ERROR_BREAKER_LINES lines), so it stopped: what it finished is in its "
                                "output and error files, the requests it did not run are in the error file.")


# The service's own failures, a 5xx line's codes (an engine or a fleet that failed, an engine out of memory): as a
# retry runs them again (is_retryable), the error-rate breaker leaves them out. A fleet outage fails every line it
# was sent; the batch is not to blame, and stopping it would fail what the fleet will run once it is back.
SERVICE_ERRORS = (c.ENGINE_ERROR, c.OUT_OF_MEMORY)


def breaker_tripped(shards: Iterable[CommittedShard], first_lines: int, rate: float | None) -> bool:
    """Whether a batch whose committed shards are `shards` must stop: at least `first_lines` of its lines have ended
    by the requests' own doing and at least `rate` of those failed; the service's own failures (SERVICE_ERRORS)
    count for neither. Never with no rate, or no `first_lines` (0: the breaker is off)."""
    if not rate or first_lines <= 0:
        return False
    total = failed = 0
    for shard in shards:
        theirs = sum(shard.error_codes.get(code, 0) for code in SERVICE_ERRORS)
        total += shard.request_counts.total - theirs
        failed += shard.request_counts.failed - theirs
    return total >= first_lines and failed >= rate * total


class Ending(NamedTuple):
    """How a batch asked to stop ends: its status, the code and message of its not-run lines, its errors.data."""

    status: BatchStatus
    code: str
    message: str
    errors: list[c.BatchError]


def stopped_ending(reason: str) -> Ending:
    """The end of a batch stopped for `reason` (a Stop.reason): a cancel or an expiry ends with that status; its
    cost cap fails it with errors.data saying so (OpenAI has no status of its own for that)."""
    if reason == COST_LIMIT:
        return Ending(BatchStatus.FAILED, c.COST_LIMIT_EXCEEDED, COST_LIMIT_NOT_RUN, [COST_LIMIT_ERROR])
    if reason == ERROR_RATE:
        return Ending(BatchStatus.FAILED, c.ERROR_RATE_EXCEEDED, ERROR_RATE_NOT_RUN, [ERROR_RATE_ERROR])
    status = BatchStatus(reason)
    return Ending(status, NOT_RUN_CODES[status], f"The batch was {reason} before this request ran.", [])


# A request is retried only when its failure was not its own: a 5xx line (engine_error, out_of_memory) or a request
# that never ran (these codes). A 4xx line would fail again the same way.
RETRIED_CODES = (c.BATCH_EXPIRED, c.BATCH_CANCELLED, c.BATCH_FAILED, c.COST_LIMIT_EXCEEDED)


def is_retryable(line: dict[str, Any]) -> bool:
    """Whether an error-file line failed for a reason that is not the request's own."""
    response = line.get("response")
    if response:
        return int(response.get("status_code") or 0) >= 500
    return (line.get("error") or {}).get("code") in RETRIED_CODES


def retryable_ids(lines: Iterable[bytes]) -> list[str]:
    """The custom_ids of the retryable lines of an error file (its raw lines), in file order."""
    return [line["custom_id"] for raw in lines if raw.strip() and is_retryable(line := orjson.loads(raw))]


def clip(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters with "…"."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# What a failure's text says of the deployment, which a client is not told: server and storage addresses (any
# scheme://..., so s3://bucket/key too) and absolute paths of two parts or more (the data folder, DAGSTER_HOME, the
# code's own files), but not an API route such as /v1/chat/completions.
_ADDRESS = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\],]*[^\s'\"<>()\[\],.:;!?]")
_PATH = re.compile(r"(?<![\w.:/~-])/(?!v1/)(?:[\w.@+~-]+/)+[\w.@+~-]*")
INTERNAL_ADDRESS, INTERNAL_PATH = "<internal address>", "<internal path>"


def public(text: str) -> str:
    """A failure's text as a client may read it (in a batch's errors.data or its error lines): its internal
    addresses and paths replaced. The operator's logs keep the whole text."""
    return _PATH.sub(INTERNAL_PATH, _ADDRESS.sub(INTERNAL_ADDRESS, text))


def not_run_lines(folder: BatchFolder, shards: Iterable[int], code: str, message: str) -> Iterator[dict[str, Any]]:
    """An error line for each request of `shards` (shards that never committed): nothing is dropped."""
    for index in shards:
        with folder.storage.local_copy(folder.shard_key(index)) as shard:
            ids = custom_ids(shard)
        for cid in ids:
            yield c.not_run_line(cid, code, message)


def _unfinished(folder: BatchFolder, code: str, message: str) -> tuple[int, Iterator[dict[str, Any]]]:
    """The shard count to merge, and an error line for each request that is in no committed shard."""
    manifest = folder.manifest()
    if manifest is None:  # failed before its shards were cut: every validated request is unfinished
        def every_request() -> Iterator[dict[str, Any]]:
            with folder.storage.local_copy(folder.requests_key) as requests:
                ids = custom_ids(requests)
            for cid in ids:
                yield c.not_run_line(cid, code, message)
        return 0, every_request()
    done = committed_shards(folder.storage, folder.results_prefix)
    missing = [i for i in range(manifest.shard_count) if i not in done]
    return manifest.shard_count, not_run_lines(folder, missing, code, message)


def keep_finished(folder: BatchFolder, reason: str, prices: PriceTable) -> Summary | None:
    """End a batch whose run failed for good (`reason`: how it failed) with what it finished.

    Writes its output file (the committed shards' output lines), its error file (their error lines, then one
    line per request that never ran), merged.json and summary.json: usage and cost count the successful
    requests only. A batch asked to stop (cancel, expiry) ends as that stop would have ended it. None when
    there is nothing to keep (the input was never validated, or was invalid); a batch that already has its
    summary keeps it.
    """
    if (ended := folder.summary()) is not None:
        return ended
    validation = folder.validation()
    if validation is None or not validation.valid or not validation.model or not validation.endpoint \
            or not folder.storage.exists(folder.requests_key):
        return None
    stop = folder.stop()
    if stop is not None and stop.reason in STOP_REASONS:
        status, code, message, errors = stopped_ending(stop.reason)
    else:
        status, code = BatchStatus.FAILED, c.BATCH_FAILED
        message = f"The batch's run failed before this request ran: {clip(reason, LINE_REASON_CHARS)}"
        errors = [c.BatchError(c.PIPELINE_ERROR, clip(reason, ERROR_REASON_CHARS))]
    shard_count, not_run = _unfinished(folder, code, message)
    with folder.storage.writing(folder.output_key) as out, folder.storage.writing(folder.error_key) as err:
        result = merge(folder.storage, folder.results_prefix, shard_count, out, err, not_run=not_run, missing_ok=True)
    folder.write_merged(Merged(status=status, request_counts=result.request_counts, usage=result.usage,
                               error_codes=result.error_codes, reused=result.reused))
    shards = committed_shards(folder.storage, folder.results_prefix).values()
    inference_s = round(sum(s.duration_s for s in shards), 3)
    cost = cost_of(result.usage, validation.model, prices, folder.completion_window())
    summary = Summary(
        batch_id=folder.batch_id, status=status, endpoint=validation.endpoint, model=validation.model,
        request_counts=result.request_counts, usage=result.usage, cost=cost,
        error_codes=result.error_codes, inference_s=inference_s,
        output_tokens_per_s=round(result.usage.output_tokens / inference_s, 1) if inference_s else 0.0,
        record={"engine_start_s": round(sum(s.engine_start_s for s in shards), 3)},
        output_file=folder.storage.uri(folder.output_key), error_file=folder.storage.uri(folder.error_key),
        completed_at=datetime.now(UTC).isoformat(timespec="seconds"), errors=errors,
    )
    folder.write_summary(summary)  # last: it is what ends the batch
    return summary
