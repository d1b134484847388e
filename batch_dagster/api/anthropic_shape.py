"""Anthropic's conventions under /v1/messages, as its SDK sends and reads them: the key in `x-api-key`, and errors as
`{"type": "error", "error": {"type", "message"}}`.

A pure ASGI layer in front of the guard, so the same keys, limits and errors apply as everywhere; only their
spelling changes. The `anthropic-version` and `anthropic-beta` headers are accepted and change nothing.
"""

from __future__ import annotations

import orjson

from batch_dagster.batchfile import anthropic

PREFIX = "/v1/messages"


def is_anthropic(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _anthropic_body(status: int, body: bytes) -> bytes:
    """An error body of ours (OpenAI's shape) in Anthropic's; a body that is not one is kept."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return body
    if not isinstance(error, dict) or "message" not in error:
        return body
    return orjson.dumps(anthropic.error_body(status, str(error["message"])))


class AnthropicShape:
    """Under /v1/messages: `x-api-key` read as the bearer key (unless an Authorization header is sent), and every
    error answered in Anthropic's shape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_anthropic(scope.get("path", "")):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = headers.get(b"x-api-key")
        if key is not None and b"authorization" not in headers:
            scope = {**scope, "headers": [*scope["headers"], (b"authorization", b"Bearer " + key)]}
        start: dict | None = None
        held: list[bytes] = []

        async def shaping_send(message):
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    return await send(message)
                start = message  # an error: held until its (small) body is whole
                return None
            if start is None:
                return await send(message)
            held.append(message.get("body", b""))
            if message.get("more_body"):
                return None
            body = _anthropic_body(start["status"], b"".join(held))
            response_headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            response_headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": response_headers})
            return await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaping_send)
