"""The batch folder contract: every path of a batch, its typed documents, over the local storage."""

from __future__ import annotations

import os
import time

import orjson
import pytest

from batch_dagster.batchfile.contract import BatchError, RequestCounts
from batch_dagster.batchfile.folder import (
    BatchFolder,
    Manifest,
    Merged,
    Progress,
    Source,
    Summary,
    Validation,
    batch_ids,
    committed_index,
    file_key,
    shard_file,
    shard_result_files,
)
from batch_dagster.batchfile.options import BatchOptions, BatchRequest
from batch_dagster.batchfile.usage import Cost, Usage
from batch_dagster.batchfile.windows import Window
from batch_dagster.storage import LocalStorage, file_location


@pytest.fixture
def folder(tmp_path) -> BatchFolder:
    return BatchFolder(LocalStorage(tmp_path), "batch_1")


def test_keys_follow_the_data_flow_under_the_batch_folder(folder, tmp_path):
    root = "batches/batch_1"
    assert (folder.input_key, folder.requests_key) == (f"{root}/input.jsonl", f"{root}/requests.parquet")
    assert folder.shard_key(3) == f"{root}/shards/shard-00003.parquet"
    assert folder.results_prefix == f"{root}/results"
    assert (folder.output_key, folder.error_key, folder.summary_key) == (
        f"{root}/output.jsonl", f"{root}/errors.jsonl", f"{root}/summary.json")
    assert shard_file(12) == "shard-00012.parquet"
    assert shard_result_files(1) == ("shard-00001.output.jsonl", "shard-00001.errors.jsonl", "shard-00001.json")
    assert file_key("file-abc") == "files/file-abc.jsonl"
    assert folder.storage.uri(folder.output_key) == str(tmp_path / root / "output.jsonl")


def test_a_file_rows_path_is_a_storage_key_or_an_older_absolute_path(folder, tmp_path):
    storage = folder.storage
    assert file_location(storage, "files/f.jsonl") == (storage, "files/f.jsonl")
    old = tmp_path / "elsewhere" / "f.jsonl"
    old.parent.mkdir()
    old.write_bytes(b"x\n")
    files, key = file_location(storage, str(old))
    assert files is not storage and files.read_bytes(key) == b"x\n"


def test_only_a_shard_summary_is_a_commit_marker():
    assert committed_index("shard-00007.json") == 7
    assert committed_index("shard-123456.json") == 123456
    for name in ("shard-00007.output.jsonl", "shard-00007.json.tmp", "progress.json", "shard-7.json"):
        assert committed_index(name) is None


def test_documents_round_trip_as_typed_objects(folder):
    assert folder.manifest() is None and folder.summary() is None and folder.validation() is None
    manifest = Manifest("batch_1", "/v1/chat/completions", "m", 5, 2, 3, [2, 2, 1])
    folder.write_manifest(manifest)
    assert folder.manifest() == manifest
    validation = Validation(valid=False, total_requests=2, model=None, endpoint=None, error_count=1,
                            errors=[BatchError("invalid_json", "x", line=2, param=None)],
                            validated_at="now")
    folder.write_validation(validation)
    assert folder.validation() == validation
    merged = Merged("completed", RequestCounts(total=1, completed=1, failed=0), Usage(input_tokens=3), {})
    folder.write_merged(merged)
    assert folder.merged() == merged
    folder.write_progress(Progress(shard=1, done=7))
    assert folder.progress() == Progress(1, 7)
    summary = Summary("batch_1", "completed", "/v1/chat/completions", "m", RequestCounts(total=1), Usage(),
                      Cost("m", 0.0, 0.0, 0.5, "USD"),
                      {}, 1.5, 2.0, {"revision": "r"}, "o", "e", "t")
    folder.write_summary(summary)
    assert folder.summary() == summary
    # Written as plain JSON, so other tools (and older readers) can read them; unknown keys are ignored.
    raw = orjson.loads(folder.storage.read_bytes(folder.summary_key))
    assert raw["status"] == "completed"
    # The typed values are written in the JSON shapes older readers know.
    assert raw["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    assert raw["usage"] == {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}
    assert raw["cost"] == {"model": "m", "input_cost": 0.0, "output_cost": 0.0, "batch_discount": 0.5,
                           "currency": "USD", "cached_input_cost": 0.0, "total_cost": 0.0}
    assert orjson.loads(folder.storage.read_bytes(folder.key(folder.VALIDATION)))["errors"] == [
        {"code": "invalid_json", "message": "x", "line": 2, "param": None}]
    folder.storage.write_bytes(folder.key("summary.json"), orjson.dumps({**raw, "added_later": 1}))
    assert folder.summary() == summary


def test_endpoint_source_deadline_and_stop(folder, tmp_path):
    assert folder.endpoint() is None and folder.source() is None and folder.stop_reason() is None
    folder.declare(BatchRequest(endpoint="/v1/embeddings"))
    assert folder.endpoint() == "/v1/embeddings" and folder.completion_window() is None
    folder.declare(BatchRequest(endpoint="/v1/embeddings", window=Window("1h", 3600)))
    assert (folder.endpoint(), folder.completion_window()) == ("/v1/embeddings", "1h")
    folder.set_source("s3://b/k.jsonl", "files/f.jsonl")
    assert folder.source() == Source("s3://b/k.jsonl", "files/f.jsonl")
    folder.set_deadline(time.time() + 60)
    assert folder.stop_reason() is None
    folder.set_deadline(time.time() - 1)
    assert folder.stop_reason() == "expired"
    folder.request_stop("cancelled")
    assert folder.stop_reason() == "cancelled"  # an explicit stop wins over the deadline


def test_input_is_copied_in_and_writes_are_atomic(folder, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"a": 1}\n')
    assert not folder.has_input()
    folder.put_input(src)
    input_path = tmp_path / folder.input_key
    assert folder.has_input() and input_path.read_bytes() == b'{"a": 1}\n'
    src.write_bytes(b"changed\n")
    assert input_path.read_bytes() == b'{"a": 1}\n'  # a copy, not a link
    leftovers = [p for p in tmp_path.rglob("*.tmp")]
    assert leftovers == []


def test_modified_at_and_listing(folder, tmp_path):
    storage = folder.storage
    assert folder.modified_at(folder.VALIDATION) is None
    folder.write_validation(Validation(True, 1, "m", "/v1/completions", 0, []))
    at = folder.modified_at(folder.VALIDATION)
    assert at is not None and abs(at - time.time()) < 5
    BatchFolder(storage, "batch_2").declare(BatchRequest(endpoint="/v1/completions"))
    assert batch_ids(storage) == ["batch_1", "batch_2"]
    assert storage.list("batches/batch_1") == ["batches/batch_1/validation.json"]
    assert storage.size("batches/batch_1/validation.json") == os.path.getsize(
        tmp_path / "batches" / "batch_1" / "validation.json")
    storage.delete("batches/batch_1/validation.json")
    assert folder.validation() is None


def test_the_batch_request_is_kept_whole_and_an_older_batch_json_still_reads(folder):
    asked = BatchRequest(owner="o", input_file_id="file-1", endpoint="/v1/chat/completions", model="m",
                         window=Window("24h", 1440), metadata={"k": "v"}, output_expires_after=7200,
                         options=BatchOptions(priority=2, reuse=True), parent_batch_id="batch_0")
    folder.declare(asked)
    assert folder.batch_request() == asked and folder.completion_window() == "24h"
    # batch.json as written before the request was kept whole: its endpoint and window, a table batch's options.
    folder.storage.write_bytes(folder.key("batch.json"), orjson.dumps(
        {"endpoint": "/v1/embeddings", "completion_window": "1h", "options": {"reuse": False}, "owner": None}))
    assert folder.batch_request() == BatchRequest(endpoint="/v1/embeddings", window=Window("1h", 0),
                                                  options=BatchOptions(reuse=False))
