"""The storage interface on local disk and on a real S3-compatible server (moto, loopback): same behaviour."""

from __future__ import annotations

import hashlib
import os

import pytest

from batch_dagster.storage import LocalStorage, open_storage
from batch_dagster.storage.s3 import S3Storage
from tests.helpers import BUCKET


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "root")
    request.getfixturevalue("bucket")
    return S3Storage(BUCKET, "team/batch-data", tmp_path / "scratch")


def test_small_objects_round_trip_and_list(storage):
    assert storage.read_bytes("batches/b1/x.json") is None
    assert not storage.exists("batches/b1/x.json") and storage.size("batches/b1/x.json") is None
    storage.write_bytes("batches/b1/x.json", b"{}")
    storage.write_bytes("batches/b1/results/shard-00000.json", b"1")
    storage.write_bytes("batches/b2/y.json", b"22")
    assert storage.read_bytes("batches/b1/x.json") == b"{}" and storage.size("batches/b2/y.json") == 2
    assert storage.list("batches/b1") == ["batches/b1/x.json"]  # files directly under it only
    assert storage.list_folders("batches") == ["batches/b1", "batches/b2"]
    assert storage.list("batches/none") == [] and storage.list_folders("nothing") == []
    assert storage.modified_at("batches/b1/x.json") is not None
    storage.delete("batches/b1/x.json")
    assert not storage.exists("batches/b1/x.json")
    storage.delete_folder("batches/b1")
    assert storage.list_folders("batches") == ["batches/b2"]


def test_writing_publishes_on_success_only(storage):
    with storage.writing("a/out.jsonl") as path:
        path.write_bytes(b"line\n")
        assert not storage.exists("a/out.jsonl")  # nothing visible before the block ends
    assert storage.read_bytes("a/out.jsonl") == b"line\n"
    with pytest.raises(RuntimeError), storage.writing("a/out.jsonl") as path:
        path.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert storage.read_bytes("a/out.jsonl") == b"line\n"  # the old object, never half a new one
    with storage.writing("a/never.parquet"):
        pass  # a writer that decides not to write
    assert not storage.exists("a/never.parquet")


def test_large_objects_stream_both_ways(storage, tmp_path):
    source = tmp_path / "big.jsonl"
    line = b'{"custom_id": "x", "body": "' + b"y" * 1000 + b'"}\n'
    with open(source, "wb") as f:
        for _ in range(20_000):  # about 20 MB: past boto3's 8 MiB multipart threshold
            f.write(line)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    storage.put_file("files/big.jsonl", source)
    assert storage.size("files/big.jsonl") == os.path.getsize(source)
    if isinstance(storage, S3Storage):  # a multipart upload's ETag names its part count
        etag = storage.client.head_object(Bucket=BUCKET, Key="team/batch-data/files/big.jsonl")["ETag"]
        assert "-" in etag
    h, reads, lines = hashlib.sha256(), 0, 0
    with storage.open("files/big.jsonl") as f:
        while chunk := f.read1(1 << 20):
            assert len(chunk) <= 1 << 20
            h.update(chunk)
            reads += 1
    assert h.hexdigest() == digest and reads >= 20
    with storage.open("files/big.jsonl") as f:
        lines = sum(1 for _ in f)
    assert lines == 20_000
    with storage.local_copy("files/big.jsonl") as local:
        assert hashlib.sha256(local.read_bytes()).hexdigest() == digest
    if isinstance(storage, S3Storage):
        assert not local.exists()  # a lent copy is scratch, removed after use
    storage.copy("files/big.jsonl", "batches/b/input.jsonl")
    assert storage.size("batches/b/input.jsonl") == os.path.getsize(source)


def test_missing_objects_are_file_not_found(storage):
    with pytest.raises(FileNotFoundError), storage.open("nope"):
        pass
    with pytest.raises(FileNotFoundError), storage.local_copy("nope"):
        pass


def test_writing_a_folder_publishes_each_file(storage):
    with storage.writing_folder("batches/b/shards") as folder:
        (folder / "shard-00000.parquet").write_bytes(b"0")
        (folder / "shard-00001.parquet").write_bytes(b"1")
    assert storage.list("batches/b/shards") == ["batches/b/shards/shard-00000.parquet",
                                                "batches/b/shards/shard-00001.parquet"]


def test_the_storage_url_chooses_the_store(tmp_path):
    assert isinstance(open_storage(str(tmp_path), tmp_path / "s"), LocalStorage)
    assert open_storage(f"file://{tmp_path}", tmp_path / "s").root == tmp_path
    s3 = open_storage("s3://bucket/some/prefix/", tmp_path / "s")
    assert isinstance(s3, S3Storage) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    assert s3.uri("batches/b/output.jsonl") == "s3://bucket/some/prefix/batches/b/output.jsonl"
    for bad in ("s3://", "gs://bucket/x"):
        with pytest.raises(ValueError, match="BATCH_STORAGE_URL"):
            open_storage(bad, tmp_path / "s")
