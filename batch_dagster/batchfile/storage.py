"""Where batch folders are kept: a small storage interface, and the local filesystem behind it.

Keys are `/`-separated paths relative to the storage's root. Writes are atomic: a reader sees the
old object or the new one, never half of one. An object store can implement the same interface.
"""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol


class Storage(Protocol):
    """What the batch folder contract needs of a store."""

    def local_path(self, key: str) -> Path:
        """A local file for `key` that the pipeline's streaming readers and writers open directly."""
        ...

    def read_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        ...

    def write_bytes(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, source: Path) -> None:
        """Copy a local file in under `key`."""
        ...

    def exists(self, key: str) -> bool: ...

    def modified_at(self, key: str) -> float | None:
        """When the object was last written (epoch seconds), or None when there is none."""
        ...

    def size(self, key: str) -> int | None: ...

    def list(self, prefix: str) -> list[str]:
        """The keys directly under the folder `prefix`."""
        ...

    def list_folders(self, prefix: str) -> builtins.list[str]:  # `list` is the method above
        """The folders directly under the folder `prefix`."""
        ...

    def delete(self, key: str) -> None: ...


class LocalStorage:
    """Batch folders on local disk under `root`; writes go through a temporary file and a rename."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def local_path(self, key: str) -> Path:
        return self.root / key

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self.local_path(key).read_bytes()
        except FileNotFoundError:
            return None

    @contextmanager
    def _atomic(self, key: str) -> Iterator[BinaryIO]:
        path = self.local_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            yield f
        tmp.replace(path)

    def write_bytes(self, key: str, data: bytes) -> None:
        with self._atomic(key) as f:
            f.write(data)

    def put_file(self, key: str, source: Path) -> None:
        with self._atomic(key) as f, open(source, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    def exists(self, key: str) -> bool:
        return self.local_path(key).exists()

    def modified_at(self, key: str) -> float | None:
        try:
            return os.stat(self.local_path(key)).st_mtime
        except FileNotFoundError:
            return None

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self.local_path(key)).st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[str]:
        folder = self.local_path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix.rstrip('/')}/{entry.name}" for entry in os.scandir(folder) if entry.is_file())

    def list_folders(self, prefix: str) -> builtins.list[str]:  # `list` is the method above
        folder = self.local_path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix.rstrip('/')}/{entry.name}" for entry in os.scandir(folder) if entry.is_dir())

    def delete(self, key: str) -> None:
        self.local_path(key).unlink(missing_ok=True)
