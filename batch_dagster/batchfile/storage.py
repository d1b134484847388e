"""Where batch folders are kept: a small storage interface, and the local filesystem behind it.

Keys are `/`-separated paths relative to the storage's root. Writes are atomic: a reader sees the
old object or the new one, never half of one. Large objects are streamed both ways: `open` reads
one in chunks, `local_copy` lends a local file of it, `writing` publishes a local file written in
place. An object store implements the same interface (batch_dagster/objectstore.py: S3).
"""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol


class Storage(Protocol):
    """What the batch folder contract needs of a store."""

    def uri(self, key: str) -> str:
        """Where the object is, for people: a local path or an s3:// URI."""
        ...

    def read_bytes(self, key: str) -> bytes | None:
        """A small object's bytes, or None when there is none."""
        ...

    def write_bytes(self, key: str, data: bytes) -> None: ...

    def open(self, key: str) -> AbstractContextManager[BinaryIO]:
        """The object as a stream read in chunks; FileNotFoundError when there is none."""
        ...

    def local_copy(self, key: str) -> AbstractContextManager[Path]:
        """A local file holding the object, for readers that need one (Parquet); FileNotFoundError when none.

        On local disk it is the object's own file; an object store downloads it to scratch and removes it after.
        """
        ...

    def writing(self, key: str) -> AbstractContextManager[Path]:
        """A local path to write the object to; published under `key` when the block ends without error (if the
        writer created the file: a writer that decides not to write leaves the object as it was)."""
        ...

    def writing_folder(self, prefix: str) -> AbstractContextManager[Path]:
        """A local folder to write files into; each is published under `prefix/<name>` when the block ends."""
        ...

    def put_file(self, key: str, source: Path) -> None:
        """Copy a local file in under `key`."""
        ...

    def copy(self, source_key: str, key: str) -> None:
        """Copy an object within the store (on S3, server-side)."""
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

    def delete_folder(self, prefix: str) -> None:
        """Remove every object under the folder `prefix`."""
        ...


class LocalStorage:
    """Batch folders on local disk under `root`; writes go through a temporary file and a rename."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def local_path(self, key: str) -> Path:
        """The file of `key` (local disk only)."""
        return self.root / key

    def uri(self, key: str) -> str:
        return str(self.local_path(key))

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self.local_path(key).read_bytes()
        except FileNotFoundError:
            return None

    @contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        path = self.local_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            yield tmp
            if tmp.exists():
                with open(tmp, "rb+") as f:  # on disk before the rename: a commit marker never names lost bytes
                    os.fsync(f.fileno())
                tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def writing_folder(self, prefix: str) -> Iterator[Path]:
        # Written in place: what marks a folder's files complete is a document written after them.
        folder = self.local_path(prefix)
        folder.mkdir(parents=True, exist_ok=True)
        yield folder

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.writing(key) as tmp:
            tmp.write_bytes(data)

    def put_file(self, key: str, source: Path) -> None:
        with self.writing(key) as tmp, open(tmp, "wb") as f, open(source, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    def copy(self, source_key: str, key: str) -> None:
        self.put_file(key, self.local_path(source_key))

    @contextmanager
    def open(self, key: str) -> Iterator[BinaryIO]:
        with open(self.local_path(key), "rb") as f:
            yield f

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        path = self.local_path(key)
        if not path.is_file():
            raise FileNotFoundError(path)
        yield path

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

    def delete_folder(self, prefix: str) -> None:
        shutil.rmtree(self.local_path(prefix), ignore_errors=True)
