"""Anthropic's Message Batches in this service's terms: a create's requests as an input file of /v1/messages lines,
and the batch's output and error lines as the results Anthropic's SDK reads.

A Message Batch is a batch like any other; only its way in and its way out speak Anthropic's format.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Iterator
from typing import Any

from . import contract as c
from .status import BatchStatus

# Anthropic's bounds on a Message Batch: its requests, and each custom_id's characters.
MAX_REQUESTS = 100_000
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}\Z")

# A batch's status as Anthropic's `processing_status`: a batch that has not ended is in progress (or canceling).
IN_PROGRESS, CANCELING, ENDED = "in_progress", "canceling", "ended"
_PROCESSING = {BatchStatus.CANCELLING: CANCELING, BatchStatus.COMPLETED: ENDED, BatchStatus.FAILED: ENDED,
               BatchStatus.EXPIRED: ENDED, BatchStatus.CANCELLED: ENDED}

# Anthropic's error types, by the HTTP status an error has.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status_code: int) -> str:
    return ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """An error as Anthropic's API answers it."""
    return {"type": "error", "error": {"type": error_type(status_code), "message": message}}


def processing_status(status: str) -> str:
    return _PROCESSING.get(BatchStatus(status), IN_PROGRESS)


def rfc3339(unix_s: int | None) -> str | None:
    """A unix time as Anthropic's timestamps are written (RFC 3339, UTC)."""
    if unix_s is None:
        return None
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat().replace("+00:00", "Z")


class RequestsError(ValueError):
    """A create's `requests` that cannot make a batch: `param` names the place (`requests.3.custom_id`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def input_line(index: int, request: Any, seen: set[str]) -> dict[str, Any]:
    """The batch input line of a create's request number `index` (`{custom_id, params}`), checked as Anthropic checks
    it: a custom_id of 1 to 64 letters, digits, `-` and `_`, unique in the batch, and params that are an object. The
    params themselves are validated as every batch's bodies are, each at its own line."""
    where = f"requests.{index}"
    if not isinstance(request, dict):
        raise RequestsError(where, f"{where}: each request must be an object with `custom_id` and `params`.")
    custom_id, params = request.get("custom_id"), request.get("params")
    if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
        raise RequestsError(f"{where}.custom_id", f"{where}.custom_id: must be 1 to 64 characters of letters, digits, "
                                                  f"'-' and '_' (got {c.quoted(custom_id)}).")
    if custom_id in seen:
        raise RequestsError(f"{where}.custom_id", f"{where}.custom_id: {custom_id!r} is used by an earlier request; "
                                                  "each custom_id must be unique within the batch.")
    seen.add(custom_id)
    if not isinstance(params, dict):
        raise RequestsError(f"{where}.params", f"{where}.params: must be an object (the Messages request).")
    extra = sorted(set(request) - {"custom_id", "params"})
    if extra:
        raise RequestsError(f"{where}.{extra[0]}", f"{where}.{extra[0]}: Extra inputs are not permitted.")
    return {"custom_id": custom_id, "method": "POST", "url": c.MESSAGES, "body": params}


def input_lines(requests: Any) -> Iterator[dict[str, Any]]:
    """Every input line of a create's `requests` (RequestsError at the first that cannot be one)."""
    if not isinstance(requests, list) or not requests:
        raise RequestsError("requests", "requests: must be a non-empty array of {custom_id, params}.")
    if len(requests) > MAX_REQUESTS:
        raise RequestsError("requests", f"requests: at most {MAX_REQUESTS:,} requests per batch "
                                        f"(got {len(requests):,}).")
    seen: set[str] = set()
    for i, request in enumerate(requests):
        yield input_line(i, request, seen)


def result(line: dict[str, Any]) -> dict[str, Any]:
    """An output or error line of the batch as Anthropic's result line: `succeeded` with its message, `canceled` or
    `expired` for a request that never ran, else `errored` with the error in Anthropic's shape (the engine's own
    Anthropic error where it gave one, its reason otherwise)."""
    custom_id = line.get("custom_id")
    response = line.get("response") or {}
    if c.is_success(line):
        return {"custom_id": custom_id, "result": {"type": "succeeded", "message": response.get("body")}}
    if not response:
        error = line.get("error") or {}
        code = error.get("code")
        if code == c.BATCH_CANCELLED:
            return {"custom_id": custom_id, "result": {"type": "canceled"}}
        if code == c.BATCH_EXPIRED:
            return {"custom_id": custom_id, "result": {"type": "expired"}}
        return _errored(custom_id, 500, str(error.get("message") or code or "The request did not run."))
    status = int(response.get("status_code") or 500)
    body = response.get("body") or {}
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    return _errored(custom_id, status, str(err.get("message") or "The request failed."),
                    kind=err.get("type") if err.get("type") in ERROR_TYPES.values() else None)


def _errored(custom_id: Any, status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    error = error_body(status, message)
    if kind is not None:
        error["error"]["type"] = kind
    return {"custom_id": custom_id, "result": {"type": "errored", "error": error}}


def results(lines: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    """The results file's lines (JSONL), one per line of the batch's output and error files."""
    for line in lines:
        yield c.jsonl_line(result(line))


def request_counts(status: str, total: int, completed: int, failed: int, error_codes: dict[str, int]) -> dict[str, int]:
    """Anthropic's `request_counts`: the requests not yet ended are processing; of the failed ones, those that never
    ran because the batch was cancelled or expired are `canceled` and `expired` (the error codes say how many)."""
    canceled = int(error_codes.get(c.BATCH_CANCELLED, 0))
    expired = int(error_codes.get(c.BATCH_EXPIRED, 0))
    processing = 0 if processing_status(status) == ENDED else max(0, total - completed - failed)
    return {"processing": processing, "succeeded": completed, "errored": max(0, failed - canceled - expired),
            "canceled": canceled, "expired": expired}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Messages body amounts to, for sizing and grouping it with others (the engine gets
    the Messages body itself): its system prompt first, then its turns' text."""
    system = body.get("system")
    text = system if isinstance(system, str) else _text(system)
    messages: list[dict[str, Any]] = [{"role": "system", "content": text}] if text else []
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            content = m.get("content")
            messages.append({"role": m.get("role"), "content": content if isinstance(content, str) else _text(content)})
    return {"model": body.get("model"), "messages": messages, "max_tokens": body.get("max_tokens")}


def _text(blocks: Any) -> str:
    if not isinstance(blocks, list):
        return ""
    return "".join(b["text"] for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str))
