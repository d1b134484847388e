"""Uploads: filename sanitizing and a JSONL sniff (their size limit is in guard.py)."""

from __future__ import annotations

import codecs
import re
import unicodedata

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

