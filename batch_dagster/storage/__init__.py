"""Where batch folders and files live: the local filesystem or S3, behind the core's Storage interface.

`open_storage` opens the store a BATCH_STORAGE_URL names; every process calls it through `settings.open_batch_storage`,
the one place that derives the URL and the scratch folder.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from batch_dagster.batchfile.storage import Storage

from .local import LocalStorage


def open_storage(url: str, scratch: Path | str) -> Storage:
    """The store BATCH_STORAGE_URL names: `s3://bucket/prefix`, or a local folder (a path or file:// URL)."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"BATCH_STORAGE_URL {url!r} names no bucket: use s3://bucket/prefix")
        from .s3 import S3Storage  # boto3 only where S3 is used

        return S3Storage(parsed.netloc, parsed.path, scratch)
    if parsed.scheme == "file":
        return LocalStorage(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # "C:" is a drive, not a scheme
        raise ValueError(f"BATCH_STORAGE_URL {url!r}: only a local path, file:// or s3:// is supported")
    return LocalStorage(url)


def file_location(storage: Storage, path: str) -> tuple[Storage, str]:
    """Where a File row's bytes are: a key in `storage`, or, for rows made before BATCH_STORAGE_URL existed,
    an absolute local path (read from local disk, as then)."""
    if path.startswith("/"):
        return LocalStorage("/"), path.lstrip("/")
    return storage, path
