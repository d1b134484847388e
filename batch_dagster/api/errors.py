"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, with their HTTP status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("batch_dagster.api")


class ApiError(Exception):
    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status_code, self.message, type=self.type, param=self.param, code=self.code)


def error_response(status_code: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind} object: {object_id}", param=param, code="not_found")


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "Invalid request."}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        param = ".".join(loc) or None
        message = f"{first['msg']}: {param}" if param else first["msg"]
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error_response(exc.status_code, message, type=kind)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("Unhandled error", exc_info=exc)
        return error_response(500, "The server had an error while processing your request.", type="server_error")
