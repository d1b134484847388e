"""Where an image part may come from, and how big it may be: validation's checks of each image a request names.

A data URL (`data:image/png;base64,...`) is checked whole here. An http(s) URL must name a host the operator allows
(BATCH_IMAGE_HOSTS); it is fetched once per batch, with the webhooks' address checks (features/images.py),
and reaches the engine as a data URL, so the engine itself fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from .contract import quoted

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
_DATA_HEAD = re.compile(r"data:image/[a-z0-9.+-]+;base64", re.I)


@dataclass(frozen=True)
class ImageSources:
    """The operator's image policy: the hosts http(s) image URLs may name (lowercase), and the bytes of one image."""

    hosts: frozenset[str] = frozenset()
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def of(cls, hosts: tuple[str, ...] | list[str], max_bytes: int) -> ImageSources:
        return cls(frozenset(h.strip().lower() for h in hosts if h.strip()), max_bytes)


def refusal(url: object, sources: ImageSources | None) -> str | None:
    """Why an image part's URL is refused (None: it is not). `sources` None: the policy is not known here (an engine
    re-checking a stored body): only the URL's form is checked, the fetch checks the host again."""
    if not isinstance(url, str):
        return None  # a type error: the schema's to report
    if url[:5].lower() == "data:":
        head, comma, payload = url.partition(",")
        if not comma or not _DATA_HEAD.fullmatch(head):
            return "an image's data URL must be data:image/<type>;base64,<data>"
        if sources is None:
            return None
        if len(payload) * 3 // 4 > sources.max_bytes:
            return f"the image is larger than {sources.max_bytes} bytes (BATCH_MAX_IMAGE_BYTES)"
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            return "the image's data URL does not hold base64 data"
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return "an image is a data URL or an http(s) URL"
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return "an image is a data URL or an http(s) URL"
    if sources is not None and parts.hostname.lower() not in sources.hosts:
        host = quoted(parts.hostname)
        return f"images are fetched only from hosts the operator allows (BATCH_IMAGE_HOSTS), not {host}"
    return None
