"""The guard in front of the app (pure ASGI): the caller's key is checked, then the body is bounded, before
any of the body is read.

A request without a right key is answered 401 from its headers alone; its body is never read. A body past
its limit (the upload limit for `POST /v1/files`, the JSON limit for everything else) is answered 413,
whether the client declared its length or sends it chunked, and is read to its end and dropped so that the
client sees the 413 rather than a broken pipe. Nothing is buffered here: the body streams through.
"""

from __future__ import annotations

from .context import AppContext
from .deps import owner_of_header
from .errors import ApiError, error_response
from .uploads import MULTIPART_SLACK

UPLOAD_PATH = "/v1/files"


class RequestGuard:
    """Authentication from the headers, then a size limit on the body, for every request under /v1."""

    def __init__(self, app, context: AppContext):
        self.app, self.context = app, context

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.context.owners and (path == "/v1" or path.startswith("/v1/")):
            try:
                owner_of_header(headers.get(b"authorization", b"").decode("latin-1"), self.context.owners)
            except ApiError as exc:
                return await exc.response()(scope, receive, send)
        limit, too_large = self._limit(scope)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _drain(receive)
            return await too_large(scope, receive, send)
        received = 0
        exceeded = False

        async def counting_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    if message.get("more_body"):
                        await _drain(receive)
                    raise _TooLarge()
            return message

        started = False

        async def guarded_send(message):
            nonlocal started
            if exceeded:
                return  # the app's answer to the cut-off body is replaced by the 413
            started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            pass
        if exceeded and not started:
            await too_large(scope, receive, send)

    def _limit(self, scope):
        """The body limit of this request, and its 413 response."""
        config = self.context.config
        if scope["method"] == "POST" and scope["path"].rstrip("/") == UPLOAD_PATH:
            return config.max_upload_bytes + MULTIPART_SLACK, error_response(
                413, f"The file is larger than the upload limit of {config.max_upload_bytes} bytes.",
                param="file", code="file_too_large")
        return config.max_json_body_bytes, error_response(
            413, f"The request body is larger than the limit of {config.max_json_body_bytes} bytes.",
            code="request_too_large")


class _TooLarge(Exception):
    pass


async def _drain(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return
