"""Streaming validation of a batch input file: every error with its line and field.

The file is read line by line and never held whole; a caller that wants the valid requests
passes `on_request` and receives each one as it is parsed, so nothing is parsed twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import orjson

from . import contract as c
from .bodies import BodyError, check_body, cut
from .fields import Serves

BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 20

# What each endpoint's body must carry besides `model`: (field, must be a list).
_REQUIRED_BODY_FIELDS = {
    c.CHAT: (("messages", True),),
    c.COMPLETIONS: (("prompt", False),),
    c.EMBEDDINGS: (("input", False),),
    c.RESPONSES: (("input", False),),
    c.SCORE: (("queries", False), ("documents", False)),
    c.RERANK: (("query", False), ("documents", False)),
    c.MESSAGES: (("messages", True),),
}

OnRequest = Callable[[int, dict[str, Any]], None]
# What the registry serves: model names, or names mapped to what each serves (its endpoints, or `Serves`).
Models = Collection[str] | Mapping[str, Serves | Collection[str]]

# Errors a report lists (the rest are counted): a batch object carries them, so it stays small
# whatever the file holds. docs/formats.md states it.
MAX_ERRORS = 100
# The code of the last entry of a capped list, which says how many errors are not listed.
MORE_ERRORS = "more_errors"
# A longer model name names no model: the line is an error, and the report names none.
MAX_MODEL_CHARS = c.MAX_MODEL_CHARS


@dataclass
class ValidationReport:
    """The outcome of validating one file."""

    total_requests: int = 0
    model: str | None = None
    endpoint: str | None = None
    errors: list[c.BatchError] = field(default_factory=list)
    error_count: int = 0  # may exceed len(errors) when the list is capped
    # Requests whose body breaks the schema (a mistyped field): the file stays valid, each of these
    # ends as its own 400 line in the error file. Capped like `errors`.
    rejected: list[c.BatchError] = field(default_factory=list)
    rejected_count: int = 0

    @property
    def valid(self) -> bool:
        return self.error_count == 0

    @property
    def shown_model(self) -> str | None:
        """The model, unless it is too long to be one (it is never stored or echoed then)."""
        return self.model if self.model is None or len(self.model) <= MAX_MODEL_CHARS else None

    @property
    def listed_errors(self) -> list[c.BatchError]:
        """The errors as a batch lists them: the first ones, then a count of the rest (`more_errors`)."""
        unlisted = self.error_count - len(self.errors)
        more = [c.BatchError(MORE_ERRORS, f"... and {unlisted} more error(s), not listed.")] if unlisted > 0 else []
        return self.errors + more

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "total_requests": self.total_requests,
            "model": self.shown_model,
            "endpoint": self.endpoint,
            "error_count": self.error_count,
            "errors": [e.to_dict() for e in self.listed_errors],
        }


class _Collector:
    def __init__(self, report: ValidationReport, max_errors: int):
        self.report = report
        self.max_errors = max_errors

    def __call__(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        self.report.error_count += 1
        if len(self.report.errors) < self.max_errors:
            self.report.errors.append(c.BatchError(code, message, line, param))

    def reject(self, message: str, line: int, param: str) -> None:
        self.report.rejected_count += 1
        if len(self.report.rejected) < self.max_errors:
            self.report.rejected.append(c.BatchError(c.INVALID_REQUEST, message, line, param))


def _lines(f: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line_no, bytes or None when too large) for each physical line, reading bounded chunks.

    Chunks are split in C (one `split` per chunk instead of one `readline` per line); an oversized
    line is dropped as it streams past, so memory stays bounded by the chunk and the line limit.
    A chunk is what the stream's buffer holds (`read1`), so the validator never reads further ahead
    of the request it reports than that buffer.
    """
    read = getattr(f, "read1", None) or (lambda: f.read(_READ_CHUNK))
    line_no = 0
    pending = b""  # the start of a line that the next chunk ends
    skipping = False  # inside an oversized line: drop bytes up to its newline
    # Room for CRLF on a line exactly at the limit, and for a BOM in front of line 1.
    hold = max_line_bytes + 2 + len(BOM)

    def finish(raw: bytes) -> tuple[int, bytes | None]:
        if line_no == 1 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        raw = raw.rstrip(b"\r")
        return line_no, (raw if len(raw) <= max_line_bytes else None)

    while chunk := read():
        parts = chunk.split(b"\n")
        last = parts.pop()
        for i, raw in enumerate(parts):
            line_no += 1
            if i == 0:
                if skipping:
                    skipping = False
                    yield line_no, None
                    continue
                raw, pending = pending + raw, b""
            yield finish(raw)
        if not skipping:
            pending += last
            if len(pending) > hold:
                pending, skipping = b"", True
    if skipping:
        line_no += 1
        yield line_no, None
    elif pending:
        line_no += 1
        yield finish(pending)


def validate_file(
    path: str | os.PathLike[str],
    *,
    limits: c.Limits = c.Limits(),
    endpoint: str | None = None,
    models: Models | None = None,
    max_errors: int = MAX_ERRORS,
    on_request: OnRequest | None = None,
) -> ValidationReport:
    """Validate a JSONL batch file.

    `models` is what the registry serves: names, or names mapped to what each serves (their endpoints, or
    `Serves`: then each body is checked against what its model takes). None skips the model check.
    """
    with open(path, "rb", buffering=_READ_CHUNK) as f:
        return validate_stream(
            f,
            size=os.fstat(f.fileno()).st_size,
            limits=limits,
            endpoint=endpoint,
            models=models,
            max_errors=max_errors,
            on_request=on_request,
        )


def validate_stream(
    f: BinaryIO,
    *,
    size: int | None = None,
    limits: c.Limits = c.Limits(),
    endpoint: str | None = None,
    models: Models | None = None,
    max_errors: int = MAX_ERRORS,
    on_request: OnRequest | None = None,
) -> ValidationReport:
    report = ValidationReport(endpoint=endpoint)
    serves = _serves_of(models)
    error = _Collector(report, max_errors)
    if endpoint is not None and endpoint not in c.ENDPOINTS:
        error(c.INVALID_URL, f"Endpoint {c.quoted(endpoint, 40)} is not one of {', '.join(c.ENDPOINTS)}.", None,
              "endpoint")
    if size is not None and size > limits.max_bytes:
        error(c.FILE_TOO_LARGE, f"The file is {size} bytes; the limit is {limits.max_bytes} bytes.")

    seen: set[str] = set()
    mixed_reported = False
    for line_no, raw in _lines(f, limits.max_line_bytes):
        if raw is None:
            error(c.LINE_TOO_LARGE, f"The line is longer than {limits.max_line_bytes} bytes.", line_no)
            report.total_requests += 1
            continue
        if not raw.strip():
            continue
        report.total_requests += 1
        request = _parse(raw, line_no, error)
        if request is None:
            continue
        if report.endpoint is None and request["url"] in c.ENDPOINTS:
            report.endpoint = request["url"]
        if not _check_request(request, line_no, report.endpoint, error, serves):
            continue
        custom_id, model = request["custom_id"], request["body"]["model"]
        if custom_id in seen:
            error(c.DUPLICATE_CUSTOM_ID, f"custom_id {c.quoted(custom_id)} appears earlier in the file.",
                  line_no, "custom_id")
            continue
        seen.add(custom_id)
        if report.model is None:
            report.model = model
            if models is not None and model not in models:
                served = ", ".join(sorted(models)) or "none"
                error(c.MODEL_NOT_FOUND, f"Model {c.quoted(model)} is not served here (served: {served}).",
                      line_no, "body.model")
            elif (known := serves(model)) is not None and known.endpoints and report.endpoint not in known.endpoints:
                served = ", ".join(known.endpoints)
                error(c.INVALID_URL, f"Model {c.quoted(model)} does not serve {report.endpoint} (it serves {served}).",
                      line_no, "url")
        elif model != report.model and not mixed_reported:
            mixed_reported = True
            error(
                c.MIXED_MODELS,
                f"Model {c.quoted(model)} differs from {c.quoted(report.model)}; a batch uses one model.",
                line_no,
                "body.model",
            )
            continue
        if on_request is not None and report.total_requests <= limits.max_requests:
            on_request(line_no, request)

    if report.total_requests == 0:
        error(c.EMPTY_FILE, "The file holds no requests.")
    elif report.total_requests > limits.max_requests:
        error(
            c.TOO_MANY_REQUESTS,
            f"The file holds {report.total_requests} requests; the limit is {limits.max_requests}.",
        )
    return report


def _parse(raw: bytes, line_no: int, error: _Collector) -> dict[str, Any] | None:
    try:
        request = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            error(c.INVALID_ENCODING, "The line is not valid UTF-8.", line_no)
        else:
            error(c.INVALID_JSON, f"The line is not valid JSON: {exc}", line_no)
        return None
    if not isinstance(request, dict):
        error(c.INVALID_REQUEST, "The line is not a JSON object.", line_no)
        return None
    for name, kind in (("custom_id", str), ("method", str), ("url", str), ("body", dict)):
        value = request.get(name)
        if not isinstance(value, kind) or (kind is str and not value):
            what = "a non-empty string" if kind is str else "an object"
            problem = "is missing" if value is None else f"must be {what}"
            error(c.INVALID_REQUEST, f"Field {name!r} {problem}.", line_no, name)
            return None
    return request


def _serves_of(models: Models | None) -> Callable[[Any], Serves | None]:
    """What a named model serves, as far as `models` says (None: nothing known of it)."""
    if not isinstance(models, Mapping):
        return lambda model: None
    known = {name: value if isinstance(value, Serves) else Serves(tuple(value)) for name, value in models.items()}
    return lambda model: known.get(model) if isinstance(model, str) else None


def _check_request(request: dict[str, Any], line_no: int, endpoint: str | None, error: _Collector,
                   serves: Callable[[Any], Serves | None]) -> bool:
    if request["method"] != "POST":
        error(c.INVALID_METHOD, f"Method {c.quoted(request['method'])} is not supported; use POST.", line_no, "method")
        return False
    url = request["url"]
    if url not in c.ENDPOINTS:
        error(c.INVALID_URL, f"URL {c.quoted(url, 40)} is not one of {', '.join(c.ENDPOINTS)}.", line_no, "url")
        return False
    if endpoint is not None and url != endpoint:
        error(c.INVALID_URL, f"URL {c.quoted(url)} differs from the batch endpoint {c.quoted(endpoint)}.",
              line_no, "url")
        return False
    body = request["body"]
    model = body.get("model")
    if not isinstance(model, str) or not model:
        error(c.INVALID_REQUEST, "Field 'body.model' is missing or not a string.", line_no, "body.model")
        return False
    if len(model) > MAX_MODEL_CHARS:
        error(c.INVALID_REQUEST, f"Field 'body.model' is {len(model)} characters long; the limit is "
              f"{MAX_MODEL_CHARS}.", line_no, "body.model")
        return False
    for name, must_be_list in _REQUIRED_BODY_FIELDS[url]:
        value = body.get(name)
        if value is None or (must_be_list and (not isinstance(value, list) or not value)):
            kind = "a non-empty list" if must_be_list else "present"
            error(c.INVALID_REQUEST, f"Field 'body.{name}' must be {kind} for {url}.", line_no, f"body.{name}")
            return False
    try:
        check_body(url, body, serves(model))
    except BodyError as exc:
        if not exc.storable:
            request["body"] = cut(body)
        error.reject(str(exc), line_no, exc.param)
    return True
