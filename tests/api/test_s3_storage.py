"""Batch folders and files on S3 (BATCH_STORAGE_URL=s3://...): the API and the pipeline work against a real
S3-compatible server (moto on loopback), and the local data dir holds nothing a batch needs."""

from __future__ import annotations

import time

import openai
import pytest

from batch_dagster.batchfile.results import committed_shards, shard_keys
from tests.helpers import BUCKET, QUIET, FakeEngine, chat_request, file_lines, rows, upload, wait_for

CHAT = "/v1/chat/completions"
PREFIX = "tenant/batch-data"


def keys(s3, prefix: str = PREFIX) -> list[str]:
    return sorted(o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
                  for o in page.get("Contents", []))


def local_files(data_dir) -> list[str]:
    """What a process left under its data dir, apart from the API store's SQLite file."""
    return sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob("*")
                  if p.is_file() and not p.name.startswith("api.db"))


def test_a_batch_lives_on_s3_from_upload_to_retry(start_service, bucket, tmp_path):
    engine = FakeEngine(fail_once={"r3"})
    service = start_service(shard_size=2, engine=engine, storage_url=f"s3://{BUCKET}/{PREFIX}")
    client = service.client()
    requests = rows(5, max_tokens=8) + [chat_request("bad-temp", "hi", temperature=-1)]
    file_id = upload(client, tmp_path / "in.jsonl", requests)
    assert keys(bucket) == [f"{PREFIX}/files/{file_id}.jsonl"]
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    batch = wait_for(client, batch.id, "completed")
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 4, "failed": 2}

    folder = service.storage.folder(batch.id)
    stored = keys(bucket, f"{PREFIX}/batches/{batch.id}/")
    for name in ("input.jsonl", "requests.parquet", "shards/manifest.json", "shards/shard-00000.parquet",
                 "results/shard-00002.json", "output.jsonl", "errors.jsonl", "summary.json"):
        assert f"{PREFIX}/batches/{batch.id}/{name}" in stored, name
    assert sorted(committed_shards(folder.storage, folder.results_prefix)) == [0, 1, 2]
    assert folder.summary().output_file == f"s3://{BUCKET}/{PREFIX}/batches/{batch.id}/output.jsonl"
    # Output and error files are served from S3 through the API.
    out, err = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in requests)
    assert client.files.retrieve(batch.output_file_id).bytes == len(client.files.content(batch.output_file_id).content)
    assert client.files.content(file_id).content == (tmp_path / "in.jsonl").read_bytes()

    # Retry on S3: the child's input is written there, and merged reads stream both batches' files.
    child = client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch)
    child = wait_for(client, child.id, "completed")
    assert child.request_counts.model_dump() == {"total": 1, "completed": 1, "failed": 0}
    merged = file_lines(client, child.output_file_id, merged=True) + file_lines(client, child.error_file_id, merged=True)
    assert sorted(x["custom_id"] for x in merged) == sorted(r["custom_id"] for r in requests)

    # Nothing under the local data dir is a batch's: scratch copies are gone once used.
    assert local_files(service.data_dir) == []

    # Deleting a file deletes its object.
    client.files.delete(batch.output_file_id)
    assert f"{PREFIX}/batches/{batch.id}/output.jsonl" not in keys(bucket)
    with pytest.raises(openai.NotFoundError):
        client.files.content(batch.output_file_id)


def test_a_rerun_on_s3_skips_committed_shards(start_service, bucket, tmp_path):
    engine = FakeEngine()
    service = start_service(shard_size=2, engine=engine, storage_url=f"s3://{BUCKET}/{PREFIX}")
    client = service.client()
    requests = rows(6, max_tokens=8)
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", requests), endpoint=CHAT,
                                  completion_window="24h")
    batch = wait_for(client, batch.id, "completed")
    folder = service.storage.folder(batch.id)
    marker = shard_keys(folder.results_prefix, 1)[2]
    kept = [f"{PREFIX}/{key}" for i in (0, 2) for key in shard_keys(folder.results_prefix, i)]
    etags = {k: bucket.head_object(Bucket=BUCKET, Key=k)["LastModified"] for k in kept}
    time.sleep(1.1)  # S3 times are whole seconds: a rewrite from now on shows in LastModified
    # Lose one commit marker, as if the run had died between the shard's lines and its marker.
    folder.storage.delete(marker)
    calls = len(engine.calls)
    service.worker.stopping.set()
    service.worker.join(60)
    result = service.worker.defs.resolve_job_def("batch_job").execute_in_process(
        partition_key=batch.id, instance=service.instance, run_config=QUIET)
    assert result.success
    assert engine.calls[calls:] == [["r3", "r2"]]  # only the shard without its marker ran again (longest first)
    for key, written in etags.items():  # the committed shards' objects are not written again
        assert bucket.head_object(Bucket=BUCKET, Key=key)["LastModified"] == written, key
    assert sorted(x["custom_id"] for x in file_lines(client, batch.output_file_id)) == [r["custom_id"] for r in requests]
