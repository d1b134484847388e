"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, with their HTTP status."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from batch_dagster.features.quotas import TYPE as LIMIT_TYPE
from batch_dagster.features.quotas import OverLimit

log = logging.getLogger("batch_dagster.api")
ECHO_CHARS = 64  # the most of a client's input an error message repeats


def clip(text: object, limit: int = ECHO_CHARS) -> str:
    """A short, printable prefix of client input for an error message (lone surrogates escaped)."""
    text = str(text)
    short = text[:limit] + ("…" if len(text) > limit else "")
    return short.encode("utf-8", "backslashreplace").decode("utf-8")


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: a lone surrogate that reached a stored value becomes U+FFFD, not a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", "replace")


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status_code, self.message, type=self.type, param=self.param, code=self.code)


def error_response(status_code: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return SafeJSONResponse(body, status_code=status_code, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind} object: {clip(object_id)}", param=param, code="not_found")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def _documented(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# The errors every operation may answer, in the OpenAPI document (FastAPI's 422 is never sent; see app.py).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _documented("Invalid request: a parameter is missing, malformed or not supported."),
    401: _documented("No API key, or not a valid one."),
    404: _documented("No such object (for this key), or its content is gone."),
    413: _documented("The request body is larger than the limit."),
    429: _documented("A limit of this key is reached: batches not yet ended, bytes of files stored, uploads "
                     "streaming at once, or estimates or lookups in flight."),
}
# The create endpoints that take an Idempotency-Key (api/idempotency.py): also the key sent with another request.
IDEMPOTENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    409: _documented("The Idempotency-Key was sent before with another request (another body or route)."),
}
# The key management endpoints' (api/keys.py): also a key that is not an admin's, and a name taken or revoked.
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    403: _documented("The key is not an admin key."),
    409: _documented("A key with this name exists already, or the key is revoked."),
}


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route serves on this path (Starlette's 405 names only the first route's)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(OverLimit)
    async def _over_limit(_request: Request, exc: OverLimit) -> JSONResponse:
        return error_response(429, exc.message, type=LIMIT_TYPE, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "Invalid request."}
        loc = [clip(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        param = clip(".".join(loc), 200) or None
        message = f"{first['msg']}: {param}" if param else first["msg"]
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"Invalid URL ({request.method} {clip(request.url.path)})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {clip(request.url.path)}."
        else:
            message = clip(exc.detail, 200)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(app, request))
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error_response(exc.status_code, message, type=kind, headers=headers)

    @app.exception_handler(UnicodeError)
    async def _bad_text(_request: Request, exc: UnicodeError) -> JSONResponse:
        # A last line: every text field is checked on the way in (schemas.Text), before anything is written.
        log.warning("Invalid Unicode reached the store: %s", exc)
        return error_response(400, "The request contains invalid Unicode (a lone surrogate).",
                              code="invalid_request")

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("Unhandled error", exc_info=exc)
        return error_response(500, "The server had an error while processing your request.", type="server_error")
