"""Uploads: a request-size guard in front of the app, filename sanitizing, and a JSONL sniff."""

from __future__ import annotations

import codecs
import re
import unicodedata

from .errors import error_response

BOM = b"\xef\xbb\xbf"
MULTIPART_SLACK = 64 * 1024  # the form's boundaries, headers and the purpose field around the file
_UNSAFE = re.compile(r'[\x00-\x1f\x7f<>:"|?*;]')


class UploadSizeLimit:
    """Answers 413 to a POST /v1/files whose body exceeds the limit, before the app stores any of it.

    The body is read to its end (and dropped) so the client sees the 413 instead of a broken pipe.
    """

    def __init__(self, app, max_body_bytes: int, path: str = "/v1/files"):
        self.app, self.max_body, self.path = app, max_body_bytes, path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != self.path:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _drain(receive)
            return await self._too_large(scope, receive, send)
        received = 0
        exceeded = False

        async def counting_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
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
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        limit = self.max_body - MULTIPART_SLACK
        response = error_response(413, f"The file is larger than the upload limit of {limit} bytes.",
                                  param="file", code="file_too_large")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _drain(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


def sanitize_filename(name: str | None, default: str = "upload.jsonl") -> str:
    """A display name safe in a header and a listing: no path, no control or shell-special characters."""
    name = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = unicodedata.normalize("NFC", name)
    name = _UNSAFE.sub("", name)
    name = " ".join(name.split()).lstrip(".").strip()
    while len(name.encode()) > 255:
        stem, dot, ext = name.rpartition(".")
        name = f"{stem[:-1]}{dot}{ext}" if dot and len(ext) < 16 and stem else name[:-1]
    return name or default


def jsonl_problem(head: bytes) -> str | None:
    """Why the start of a file is not JSONL (None when it looks like it): the full check is the pipeline's."""
    text = head.removeprefix(BOM)
    if not text.strip():
        return "The file is empty."
    try:
        codecs.getincrementaldecoder("utf-8")().decode(text, final=False)
    except UnicodeDecodeError:
        return "The file is not UTF-8 text."
    if not text.lstrip().startswith(b"{"):
        return "The file is not JSONL: its first line is not a JSON object."
    return None

