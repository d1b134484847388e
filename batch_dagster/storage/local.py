"""Batch folders and files on local disk: the Storage interface over a folder, writes by rename. What it creates is
its user's alone (files 0600, folders 0700, whatever the umask): uploads and batches are tenants' data."""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

FILE_MODE, FOLDER_MODE = 0o600, 0o700


def private_folder(folder: Path) -> None:
    """Create `folder` and its missing parents, each FOLDER_MODE (mkdir's mode is cut by the umask, and parents made
    by `parents=True` ignore it): a folder that exists already is left as it is."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=FOLDER_MODE)
        except FileExistsError:  # made meanwhile by another writer
            continue
        os.chmod(path, FOLDER_MODE)


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
        private_folder(path.parent)
        tmp = path.with_name(path.name + ".tmp")
        try:
            yield tmp
            if tmp.exists():
                with open(tmp, "rb+") as f:  # on disk before the rename: a commit marker never names lost bytes
                    os.fchmod(f.fileno(), FILE_MODE)
                    os.fsync(f.fileno())
                tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def writing_folder(self, prefix: str) -> Iterator[Path]:
        # Written in place: what marks a folder's files complete is a document written after them.
        folder = self.local_path(prefix)
        private_folder(folder)
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

    def total_size(self, prefix: str) -> int:
        total = 0
        for folder, _, names in os.walk(self.local_path(prefix)):
            for name in names:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:  # removed while walked
                    pass
        return total

    def delete(self, key: str) -> None:
        self.local_path(key).unlink(missing_ok=True)

    def delete_folder(self, prefix: str) -> None:
        shutil.rmtree(self.local_path(prefix), ignore_errors=True)
