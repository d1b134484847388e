"""Batch folders and files on S3 (any S3-compatible store).

Objects are written whole (a PUT, or a multipart upload that S3 makes visible only when complete),
so the storage interface's atomic writes hold. Large objects never pass through memory whole:
uploads and downloads go through boto3's transfer manager (multipart, in 8 MiB parts), reads stream.
Local files an S3 store lends or collects live under its scratch folder and are removed after use.
Endpoint, region and credentials are boto3's own configuration (AWS_ENDPOINT_URL, AWS_*).
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 1 << 20


class _Body(io.RawIOBase):
    """An S3 object's streaming body as a raw stream, so a BufferedReader (with read1) can sit on it."""

    def __init__(self, body: Any):
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.body.close()
        super().close()


def _missing(exc: Exception) -> bool:
    error = getattr(exc, "response", {}).get("Error", {})
    return str(error.get("Code")) in ("404", "NoSuchKey", "NotFound")


class S3Storage:
    """Batch folders under `s3://bucket/prefix/`; `scratch` holds the local files lent to readers and writers."""

    def __init__(self, bucket: str, prefix: str, scratch: Path | str, client: Any = None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.scratch = Path(scratch)
        self._client = client

    def __repr__(self) -> str:
        return f"S3Storage({self.uri('')!r})"

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3  # only a process that uses S3 pays for boto3's import

            self._client = boto3.client("s3")
        return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}".rstrip("/")

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if _missing(exc):
                return None
            raise

    def read_bytes(self, key: str) -> bytes | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if _missing(exc):
                return None
            raise
        with obj["Body"] as body:
            return body.read()

    def write_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_file(self, key: str, source: Path) -> None:
        self.client.upload_file(str(source), self.bucket, self._key(key))

    def copy(self, source_key: str, key: str) -> None:
        # The managed copy: one CopyObject, or a multipart copy for large objects; the bytes stay in the store.
        self.client.copy({"Bucket": self.bucket, "Key": self._key(source_key)}, self.bucket, self._key(key))

    @contextmanager
    def open(self, key: str) -> Iterator[BinaryIO]:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(self.uri(key)) from exc
            raise
        with io.BufferedReader(_Body(obj["Body"]), buffer_size=CHUNK) as stream:
            yield stream

    def _scratch_file(self, key: str) -> Path:
        self.scratch.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.scratch, suffix="-" + key.rsplit("/", 1)[-1])
        os.close(fd)
        return Path(name)

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        path = self._scratch_file(key)
        try:
            try:
                self.client.download_file(self.bucket, self._key(key), str(path))
            except Exception as exc:
                if _missing(exc):
                    raise FileNotFoundError(self.uri(key)) from exc
                raise
            yield path
        finally:
            path.unlink(missing_ok=True)

    @contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        path = self._scratch_file(key)
        path.unlink()  # a writer that writes nothing publishes nothing
        try:
            yield path
            if path.exists():
                self.put_file(key, path)
        finally:
            path.unlink(missing_ok=True)

    @contextmanager
    def writing_folder(self, prefix: str) -> Iterator[Path]:
        self.scratch.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=self.scratch))
        try:
            yield folder
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if entry.is_file():
                    self.put_file(f"{prefix.rstrip('/')}/{entry.name}", Path(entry.path))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def modified_at(self, key: str) -> float | None:
        head = self._head(key)
        return None if head is None else head["LastModified"].timestamp()

    def size(self, key: str) -> int | None:
        head = self._head(key)
        return None if head is None else int(head["ContentLength"])

    def _listing(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/")) + "/", Delimiter="/")
        yield from pages

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def list(self, prefix: str) -> list[str]:
        return sorted(self._relative(o["Key"]) for page in self._listing(prefix) for o in page.get("Contents", []))

    def list_folders(self, prefix: str) -> builtins.list[str]:  # `list` is the method above
        return sorted(self._relative(p["Prefix"]).rstrip("/")
                      for page in self._listing(prefix) for p in page.get("CommonPrefixes", []))

    def total_size(self, prefix: str) -> int:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/")) + "/")
        return sum(int(o["Size"]) for page in pages for o in page.get("Contents", []))

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_folder(self, prefix: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/")) + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
