"""Uploads: filename sanitizing, a JSONL sniff, the count and hash of a streaming upload's file bytes and the uploads
each key has streaming at once (the guard, guard.py, holds them to their limits)."""

from __future__ import annotations

import codecs
import hashlib
import re
import unicodedata

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

BOM = b"\xef\xbb\xbf"
MULTIPART_SLACK = 64 * 1024  # the form's boundaries, headers and the purpose field around the file
_INVISIBLE = ("Cc", "Cf", "Cs")
_UNSAFE = re.compile(r'[\x00-\x1f\x7f<>:"|?*;]')


def sanitize_filename(name: str | None, default: str = "upload.jsonl") -> str:
    """A display name safe in a header and a listing: no path, no control, format or shell-special characters."""
    name = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = unicodedata.normalize("NFC", name)
    name = _UNSAFE.sub("", name)
    # Control, format (bidi overrides such as U+202E, zero-width characters) and lone surrogates go too.
    name = "".join(c for c in name if unicodedata.category(c) not in _INVISIBLE)
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



class UploadMeter:
    """The bytes of an upload's file parts, counted as its body streams in by the parser Starlette's own form parsing
    uses (python-multipart), so that a limit on the file holds to the byte, before the app spools any of it: the
    form's other fields and its framing are not the file's. A body that is not a multipart form (or stops being a
    well-formed one) is counted whole from there on; the app's form parsing refuses it anyway. The file bytes are
    hashed as they pass (`sha256`): what an Idempotency-Key's repeat is told by, whatever the form's boundary."""

    def __init__(self, content_type: bytes):
        self.bytes = 0
        self.sha256 = hashlib.sha256()
        self._in_file = False
        self._header, self._value, self._disposition = b"", b"", b""
        kind, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        self._parser: MultipartParser | None = None
        if kind == b"multipart/form-data" and boundary:
            self._parser = MultipartParser(boundary, {
                "on_part_begin": self._part_begins, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_ends,
                "on_headers_finished": self._headers_end, "on_part_data": self._part_data})

    def feed(self, chunk: bytes) -> int:
        """Count `chunk` of the body; the file bytes so far."""
        if self._parser is not None:
            try:
                self._parser.write(chunk)
                return self.bytes
            except FormParserError:
                self._parser = None
        self.bytes += len(chunk)
        return self.bytes

    def _part_begins(self) -> None:
        self._in_file, self._disposition = False, b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_ends(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def _headers_end(self) -> None:
        self._in_file = b"filename" in parse_options_header(self._disposition)[1]  # as Starlette tells a file

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.bytes += end - start
            self.sha256.update(data[start:end])


class UploadSlots:
    """The uploads each key has streaming into this API process. Taken and given back on the event loop's thread (the
    guard's), so no lock."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def take(self, owner: str, limit: int | None) -> bool:
        """One more upload of `owner`, unless it has `limit` already (None: no limit)."""
        held = self._held.get(owner, 0)
        if limit is not None and held >= limit:
            return False
        self._held[owner] = held + 1
        return True

    def give_back(self, owner: str) -> None:
        left = self._held.pop(owner) - 1
        if left:
            self._held[owner] = left
