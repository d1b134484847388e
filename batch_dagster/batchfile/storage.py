"""Where batch folders are kept: the small storage interface the batch folder contract needs.

Keys are `/`-separated paths relative to the storage's root. Writes are atomic: a reader sees the
old object or the new one, never half of one. Large objects are streamed both ways: `open` reads
one in chunks, `local_copy` lends a local file of it, `writing` publishes a local file written in
place. batch_dagster/storage/ implements it: the local filesystem (local.py) and S3 (s3.py).
"""

from __future__ import annotations

import builtins
from contextlib import AbstractContextManager
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

    def total_size(self, prefix: str) -> int:
        """The bytes of every object under the folder `prefix`, its subfolders' included (0: none)."""
        ...

    def delete(self, key: str) -> None: ...

    def delete_folder(self, prefix: str) -> None:
        """Remove every object under the folder `prefix`."""
        ...
