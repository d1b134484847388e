"""Moving files in and out of a batch's folder: from and to S3 (any S3-compatible store) or a local folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

S3Client = Any


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def split_s3(uri: str) -> tuple[str, str]:
    """s3://bucket/key -> (bucket, key)."""
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


def local_path(uri: str) -> Path:
    """file:///abs/path -> Path."""
    return Path(unquote(urlparse(uri).path))


def fetch(uri: str, dest: Path, s3: Callable[[], S3Client]) -> int:
    """Copy the file at `uri` to `dest` (atomically: a half-copied file never has the final name); its size."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        s3().download_file(bucket, key, str(tmp))
    else:
        # O_NOFOLLOW: a dropped file swapped for a symbolic link after the inbox took it is refused, not followed.
        fd = os.open(local_path(uri), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    tmp.replace(dest)
    return dest.stat().st_size


def deliver(files: Mapping[str, Path], dest_uri: str, s3: Callable[[], S3Client]) -> list[str]:
    """Write each file under the folder or prefix `dest_uri` by its name; the URIs written."""
    written = []
    if dest_uri.startswith("s3://"):
        bucket, prefix = split_s3(dest_uri)
        client = s3()
        for name, path in files.items():
            client.upload_file(str(path), bucket, prefix + name)
            written.append(s3_uri(bucket, prefix + name))
        return written
    folder = local_path(dest_uri)
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        tmp = folder / f".{name}.part"
        shutil.copyfile(path, tmp)
        os.replace(tmp, folder / name)
        written.append(str(folder / name))
    return written
