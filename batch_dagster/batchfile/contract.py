"""The OpenAI Batch contract: endpoints, error codes, limits and the shape of output lines."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, fields
from typing import Any

import orjson

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
SCORE = "/v1/score"  # vLLM's: the similarity of queries and documents
RERANK = "/v1/rerank"  # vLLM's (Jina and Cohere's shape): documents ranked for a query
MESSAGES = "/v1/messages"  # Anthropic's Messages API, served by vLLM's own layer (vllm/entrypoints/anthropic)
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, SCORE, RERANK, MESSAGES)

# The longest values the store keeps from a client (db/models.py sizes its columns by them). Each is checked
# where it comes in (the API, validation, the drop intake), so no write of one tenant's value fails later.
MAX_MODEL_CHARS = 255  # body.model, recorded on the batch and its run's tags
MAX_FILENAME_CHARS = 255  # a File's name
MAX_SOURCE_CHARS = 1024  # a dropped file's s3:// or file:// URI
MAX_VERSION_CHARS = 255  # its ETag, or size and mtime
MAX_COST = 1e9  # a batch's max_cost, in the price table's currency
# The texts one /v1/score or /v1/rerank line may hold (its queries, its documents: each list at most this long). vLLM
# sets no bound; Cohere's rerank takes up to 1,000 documents a call. Each text is embedded and counted apart, so a line
# of 500,000 texts would be as much work as 500,000 lines, past every per-file bound.
MAX_SCORE_TEXTS = 1_000
# A legacy completion without max_tokens generates at most 16 tokens (OpenAI's default, and vLLM's server's).
COMPLETIONS_MAX_TOKENS = 16


def _first_request(head: bytes, whole: bool) -> dict[str, Any] | None:
    """A file's first request, from its first bytes; None when that line is cut off or not a JSON object.
    `whole`: the bytes are the whole file, so a last line without a newline counts."""
    lines = head.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    for raw in lines if whole else lines[:-1]:
        if raw.strip():
            try:
                first = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return None
            return first if isinstance(first, dict) else None
    return None


def endpoint_of_head(head: bytes, default: str = CHAT) -> str:
    """The endpoint a file's first request names, read from its first bytes; `default` when that line
    is cut off, not a request or names no endpoint we serve (validation then reports it)."""
    first = _first_request(head, whole=False)
    url = first.get("url") if first else None
    return url if url in ENDPOINTS else default


def model_of_head(head: bytes, whole: bool = False) -> str | None:
    """The model a file's first request names, read from its first bytes (`whole`: they are the whole file);
    None when that line is cut off or names no model. Validation later checks every line against it."""
    first = _first_request(head, whole)
    body = first.get("body") if first else None
    model = body.get("model") if isinstance(body, dict) else None
    # A longer name names no model here: validation reports it (line 1, body.model).
    return model if isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS else None


# Validation error codes (file-level and line-level).
EMPTY_FILE = "empty_file"
FILE_TOO_LARGE = "file_too_large"
TOO_MANY_REQUESTS = "too_many_requests"
LINE_TOO_LARGE = "line_too_large"
INVALID_ENCODING = "invalid_encoding"
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
INVALID_METHOD = "invalid_method"
INVALID_URL = "invalid_url"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MIXED_MODELS = "mixed_models"
MODEL_NOT_FOUND = "model_not_found"
TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"  # the owner's enqueued prompt tokens for the model
# The batch's cost cap (max_cost, the key's daily budget): at validation, in errors.data; while it runs, on the
# error lines of the requests it did not run (features/cost_cap.py).
COST_LIMIT_EXCEEDED = "cost_limit_exceeded"
# A request whose prompt tokens were not counted by their deadline (its chat template renders too long, or an estimate's
# file outlasted BATCH_ESTIMATE_TIMEOUT_S): the count stopped there (engine/tokens.py).
COUNT_TIMEOUT = "count_timeout"
# The error-rate breaker: nearly every one of the batch's first lines failed, so it stopped (batchfile/failure.py).
ERROR_RATE_EXCEEDED = "error_rate_exceeded"

# Request-level error codes written to the error file.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
ENGINE_ERROR = "engine_error"
OUT_OF_MEMORY = "out_of_memory"  # a request that alone ran the engine out of memory
BATCH_EXPIRED = "batch_expired"
BATCH_CANCELLED = "batch_cancelled"
BATCH_FAILED = "batch_failed"  # the batch's run failed for good before this request ran
# The batch-level error (errors.data) of a batch whose pipeline run failed.
PIPELINE_ERROR = "pipeline_error"


@dataclass(frozen=True)
class Limits:
    """Per-file limits (OpenAI's and Model Studio's defaults)."""

    max_requests: int = 50_000
    max_bytes: int = 200 * 1024 * 1024
    max_line_bytes: int = 6 * 1024 * 1024

    @classmethod
    def of(cls, source: Any) -> Limits:
        """The limits an object holds as fields of the same names (the settings, the pipeline's resource)."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class BatchError:
    """One entry of a batch's `errors.data`: what is wrong and where (1-based line, or None)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchError:
        return cls(code=d.get("code") or "unknown", message=d.get("message") or "", line=d.get("line"),
                   param=d.get("param"))


@dataclass
class RequestCounts:
    """The Batch object's `request_counts`. Two extensions count completed requests whose structured answer is not
    what they asked for (batchfile/structured.py): `incomplete_structured`, cut short by their token limit, and
    `invalid_structured`, whole but not following its schema."""

    total: int = 0
    completed: int = 0
    failed: int = 0
    incomplete_structured: int = 0
    invalid_structured: int = 0

    def __iadd__(self, other: RequestCounts) -> RequestCounts:
        self.total += other.total
        self.completed += other.completed
        self.failed += other.failed
        self.incomplete_structured += other.incomplete_structured
        self.invalid_structured += other.invalid_structured
        return self

    def to_dict(self) -> dict[str, int]:
        """OpenAI's three counts, and each extension only when there is something to say."""
        counts = {"total": self.total, "completed": self.completed, "failed": self.failed}
        return counts | {name: n for name in STRUCTURED_COUNTS if (n := getattr(self, name))}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestCounts:
        return cls(total=d.get("total", 0), completed=d.get("completed", 0), failed=d.get("failed", 0),
                   **{name: d.get(name, 0) for name in STRUCTURED_COUNTS})

    def describe(self) -> str:
        """For a person: "40 total, 38 completed, 2 failed", and the structured answers cut short or invalid."""
        notes = [f"{n} {what}" for n, what in ((self.incomplete_structured, "with structured output cut short by "
                                                "its token limit"),
                                               (self.invalid_structured, "not following their schema")) if n]
        shown = f" ({', '.join(notes)})" if notes else ""
        return f"{self.total} total, {self.completed} completed{shown}, {self.failed} failed"


# The counts of completed requests whose structured answer is not what they asked for, and the extension field that
# marks such a line with its first violation (batchfile/structured.py).
STRUCTURED_COUNTS = ("incomplete_structured", "invalid_structured")
INVALID_STRUCTURED = "invalid_structured"
# What a retry may take from its parent (features/retry.py): its retryable failed requests (the default), and its
# lines marked as not following their schema, whole or cut short.
FAILED_LINES = "failed"
RETRY_FILTERS = (FAILED_LINES, *STRUCTURED_COUNTS)


def quoted(value: Any, limit: int = 64) -> str:
    """A client's value as an error message quotes it: its repr, cut to `limit` characters with "…" and
    the value's length, so a message stays small whatever the client sent (a 20 MB url, a long model)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, (str, bytes, list, dict)) else len(text)
    return f"{text[:limit]}… ({size} characters)"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


# Characters that line splitters wider than "\n" break at, as their UTF-8 bytes and their JSON escapes. Python's
# str.splitlines() breaks at U+2028, U+2029 and U+0085 (which orjson writes raw) and at \x0b, \x0c, \x1c-\x1e (which
# JSON escapes already). In JSON text they can only stand inside strings, and their bytes can only be these characters
# (0xC2 and 0xE2 only ever start a character in UTF-8), so escaping them keeps the same JSON value.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def one_line(json_text: bytes) -> bytes:
    """JSON text (UTF-8) with the characters any common line splitter breaks at written as JSON escapes (\\u2028,
    \\u2029, \\u0085): the same value, read as one line by `str.splitlines()` as by a reader that splits at "\\n"."""
    for raw, escaped in _LINE_BREAKS:
        if raw in json_text:
            json_text = json_text.replace(raw, escaped)
    return json_text


def jsonl_line(obj: Any) -> bytes:
    """`obj` as one line of a JSONL file the service writes, newline included (see `one_line`)."""
    return one_line(orjson.dumps(obj)) + b"\n"


def success_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """An output-file line for a request that ran: status 200 and the endpoint's response object."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": new_id("req_"), "body": body},
        "error": None,
    }


# An output line's extension key: its answer was taken from the answer store (features/reuse.py), not computed
# again, and it is billed at zero.
REUSED = "reused"


def reused_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """An output-file line whose answer (the response `body` of an earlier request) was reused."""
    return {**success_line(custom_id, body), REUSED: True}


def request_error_line(
    custom_id: str,
    code: str,
    message: str,
    *,
    param: str | None = None,
    status_code: int = 400,
    error_type: str | None = None,
) -> dict[str, Any]:
    """An error-file line for a request the engine rejected or could not serve."""
    if error_type is None:
        error_type = "invalid_request_error" if status_code < 500 else "server_error"
    error = {"message": message, "type": error_type, "param": param, "code": code}
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": new_id("req_"), "body": {"error": error}},
        "error": None,
    }


def not_run_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """An error-file line for a request that never ran (batch expired or cancelled)."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def is_success(line: dict[str, Any]) -> bool:
    response = line.get("response")
    if not response:
        return False
    return response.get("status_code") == 200 and line.get("error") is None


def is_billed(line: dict[str, Any]) -> bool:
    """Whether a line's usage is billed: a request that ran now and succeeded (a reused answer costs nothing)."""
    return is_success(line) and not line.get(REUSED)
