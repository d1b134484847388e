"""The guard in front of the app (pure ASGI): the caller's key is checked, then the body is bounded, before
any of the body is read.

A request without a live key is answered 401 from its headers alone (the key looked up in the store, so a revoked
one is refused at once); the caller found is the request's `state.caller`. A body past its limit (the upload limit
for `POST /v1/files`, the JSON limit for everything else) is answered 413, whether the client declared its length
or sends it chunked. An upload is also held to its key's limits before the app reads it: the key's uploads
streaming at once (429 `too_many_uploads`) and the bytes it may still store (429 `storage_limit_exceeded`, from the
declared length, then from the file's bytes as they arrive, counted to the byte: the app never gets a chunk past
the limit). A refused request's connection is then closed (`connection: close`) after at most LINGER_BYTES more of
its body, or LINGER_S: time for the client to read the answer, never the whole body. Nothing is buffered here: the
body streams through.
"""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from batch_dagster.db import idempotency
from batch_dagster.features.quotas import TYPE as LIMIT_TYPE
from batch_dagster.features.quotas import OverLimit, storage_exceeded, stored_room

from .context import AppContext
from .deps import caller_of_header
from .errors import ApiError, error_response
from .idempotency import valid_key
from .uploads import MULTIPART_SLACK, UploadMeter

UPLOAD_PATH = "/v1/files"
METER = "upload_meter"  # the request state's name of an upload's UploadMeter
INLINE_PATH = "/v1/messages/batches"


class RequestGuard:
    """Authentication from the headers, then a size limit on the body, for every request under /v1; an upload's
    key limits too."""

    def __init__(self, app, context: AppContext):
        self.app, self.context = app, context

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = route_path(scope)
        owner = None
        if path == "/v1" or path.startswith("/v1/"):
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            try:
                caller = await run_in_threadpool(caller_of_header, authorization, self.context)
            except ApiError as exc:
                return await _refuse(exc.response(), receive, send)
            scope.setdefault("state", {})["caller"] = caller
            owner = caller.owner
        upload = owner is not None and scope["method"] == "POST" and path.rstrip("/") == UPLOAD_PATH
        # A Message Batch's requests come inline: its body is its input file, bounded as an upload is.
        limit, too_large = self._limit(upload or (scope["method"] == "POST" and path.rstrip("/") == INLINE_PATH))
        text = headers.get(b"content-length")
        declared = int(text) if text is not None and text.isdigit() else None
        if declared is not None and declared > limit:
            return await _refuse(too_large, receive, send)
        if owner is None or not upload:
            return await _bounded(self.app, scope, receive, send, limit, too_large)
        await self._upload(scope, receive, send, owner, declared, limit, too_large)

    async def _upload(self, scope, receive, send, owner: str, declared: int | None, limit: int,
                      too_large: Response) -> None:
        """An upload of `owner`, held to the key's uploads at once and to its room, then bounded as any body. The
        repeat of an upload (an Idempotency-Key the owner sent before) is not held to its room: it stores nothing."""
        headers = dict(scope["headers"])
        bound = self.context.config.key_max_uploads
        if not self.context.uploads.take(owner, bound):
            return await _refuse(_limit_response(OverLimit(
                f"This key has {bound} uploads streaming in already, its limit (BATCH_KEY_MAX_UPLOADS); send the next "
                "when one has ended.", code="too_many_uploads", param="file")), receive, send)
        try:
            file_limits = [(self.context.config.max_upload_bytes, too_large)]
            key = headers.get(b"idempotency-key", b"").decode("latin-1")
            if (room := await run_in_threadpool(self._room, owner, key)) is not None:
                most, left = room
                full = _limit_response(storage_exceeded(most))
                # The declared length holds the form around the file too: refused only when the file cannot fit.
                if left <= 0 or (declared is not None and declared > left + MULTIPART_SLACK):
                    return await _refuse(full, receive, send)
                file_limits.insert(0, (left, full))
            meter = UploadMeter(headers.get(b"content-type", b""))
            scope.setdefault("state", {})[METER] = meter  # the route's fingerprint of the file (api/files.py)
            await _bounded(self.app, scope, receive, send, limit, too_large, (meter, file_limits))
        finally:
            self.context.uploads.give_back(owner)

    def _room(self, owner: str, key: str) -> tuple[int, int] | None:
        with self.context.db.session() as session:
            if valid_key(key) and idempotency.find(session, owner, key) is not None:
                return None
            return stored_room(session, owner, self.context.config)

    def _limit(self, upload: bool) -> tuple[int, Response]:
        """The body limit of this request, and its 413 response."""
        config = self.context.config
        if upload:
            return config.max_upload_bytes + MULTIPART_SLACK, error_response(
                413, f"The file is larger than the upload limit of {config.max_upload_bytes} bytes.",
                param="file", code="file_too_large")
        return config.max_json_body_bytes, error_response(
            413, f"The request body is larger than the limit of {config.max_json_body_bytes} bytes.",
            code="request_too_large")


def _limit_response(over: OverLimit) -> Response:
    return error_response(429, over.message, type=LIMIT_TYPE, param=over.param, code=over.code)


async def _bounded(app, scope, receive, send, limit: int, too_large: Response,
                   upload: tuple[UploadMeter, list[tuple[int, Response]]] | None = None) -> None:
    """Run the app on a body cut at `limit` bytes (then answered `too_large`) and, for an upload, at the first of its
    (bytes, answer) limits its file's bytes pass: the chunk that passes one never reaches the app."""
    received = 0
    refusal: Response | None = None

    async def counting_receive():
        nonlocal received, refusal
        message = await receive()
        if message["type"] == "http.request":
            body = message.get("body", b"")
            received += len(body)
            if received > limit:
                refusal = too_large
            elif upload is not None:
                meter, limits = upload
                file_bytes = meter.feed(body)
                refusal = next((answer for bound, answer in limits if file_bytes > bound), None)
            if refusal is not None:
                raise _TooLarge()
        return message

    started = False

    async def guarded_send(message):
        nonlocal started
        if refusal is not None:
            return  # the app's answer to the cut-off body is replaced by the refusal
        started = True
        await send(message)

    try:
        await app(scope, counting_receive, guarded_send)
    except _TooLarge:
        pass
    if refusal is not None and not started:
        await _refuse(refusal, receive, send)


def route_path(scope) -> str:
    """The path the routes match: behind a proxy that serves the API under a prefix (uvicorn's --root-path), the
    server puts the prefix in front of every path, and the routes match what follows it (as Starlette's router)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


class _TooLarge(Exception):
    pass


# What a refused request's body may still cost: read after the answer, so that closing the connection does not
# reset it before the client has read the answer (a close on unread data sends a reset), then dropped.
LINGER_BYTES = 64 * 1024
LINGER_S = 1.0


async def _refuse(response: Response, receive, send) -> None:
    """Send `response` with `connection: close`, then end it once the client has had LINGER_S or sent LINGER_BYTES
    more: the server (uvicorn) closes the connection when the answer ends, unread body and all."""
    headers = [(k, v) for k, v in response.raw_headers if k != b"connection"] + [(b"connection", b"close")]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    # All of the answer (its content-length is met), but not yet its end for the server, which would close at once.
    await send({"type": "http.response.body", "body": response.body, "more_body": True})
    await _linger(receive)
    await send({"type": "http.response.body", "body": b""})


async def _linger(receive) -> None:
    """Read and drop the body until it ends or LINGER_BYTES were read, then wait out LINGER_S without reading
    (the server's flow control stops the client), so a client that sends on still gets to read the answer."""
    loop = asyncio.get_running_loop()
    deadline, read = loop.time() + LINGER_S, 0
    while (left := deadline - loop.time()) > 0:
        if read >= LINGER_BYTES:
            return await asyncio.sleep(left)
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body"):
            return
        read += len(message.get("body", b""))
