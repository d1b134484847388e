"""Dropped files: the S3 sensor against a real S3-compatible server on loopback (moto), and the inbox sensor.

Sensors are evaluated as the daemon does and their runs executed in-process against a test
instance; the REST API (openai SDK) must list the batches they create. The same drops on the real
engine are in tests/system/test_intake.py.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import dagster as dg
import pytest

from batch_dagster.defs.resources import DatabaseResource, Intake
from batch_dagster.defs.sensors import inbox_sensor, s3_upload_sensor
from batch_dagster.settings import Settings
from tests.helpers import (
    BUCKET,
    CHAT_MODEL,
    EMBED_MODEL,
    FAKES,
    Daemon,
    FakeEngine,
    FakeVLLM,
    chat_request,
    fake_vllm,
    jsonl,
    rows,
    s3_json,
    s3_lines,
)


@pytest.mark.parametrize("storage_url", ["", f"s3://{BUCKET}/batch-data"], ids=["local-folders", "s3-folders"])
def test_s3_drops_become_batches_with_results_beside_them(tmp_path, bucket, storage_url):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("s3", engine), storage_url=storage_url)
    bucket.put_object(Bucket=BUCKET, Key="incoming/labels.jsonl", Body=jsonl(rows(5)))
    bucket.put_object(Bucket=BUCKET, Key="incoming/notes.txt", Body=b"not a batch")
    bucket.put_object(Bucket=BUCKET, Key="elsewhere/other.jsonl", Body=jsonl(rows(2)))

    runs = daemon.until_delivered(s3_upload_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    batch_id = runs[0][1]
    assert runs[1][1] == batch_id
    assert daemon.instance.get_dynamic_partitions("batches") == [batch_id]

    prefix = f"results/{batch_id}/"
    keys = {o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    assert keys == {prefix + "output.jsonl", prefix + "errors.jsonl", prefix + "summary.json"}
    assert sorted(l["custom_id"] for l in s3_lines(bucket, prefix + "output.jsonl")) == [f"r{i}" for i in range(5)]
    assert s3_lines(bucket, prefix + "errors.jsonl") == []
    summary = s3_json(bucket, prefix + "summary.json")
    assert summary["status"] == "completed" and summary["source"] == f"s3://{BUCKET}/incoming/labels.jsonl"
    assert summary["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert summary["cost"]["total_cost"] > 0 and summary["usage"]["output_tokens"] > 0
    assert {"id", "source", "status", "endpoint", "model", "request_counts", "usage", "cost", "errors", "files",
            "created_at", "completed_at"} <= set(summary)  # the batch as the API shows it, its source and files

    # The REST API lists the batch, with its input file, like an uploaded one.
    with ExitStack() as stack:
        client = daemon.api(stack)
        listed = client.batches.list().data
        assert [b.id for b in listed] == [batch_id]
        assert listed[0].status == "completed" and listed[0].metadata == {"source": summary["source"]}
        assert listed[0].request_counts.completed == 5
        assert client.files.content(listed[0].input_file_id).read() == jsonl(rows(5))
    if storage_url:  # the batch's folder and its File are on S3; locally there is only the SQLite store
        assert {p.name for p in daemon.data_dir.rglob("*") if p.is_file()} <= {"api.db", "api.db-shm", "api.db-wal"}

    # Nothing new: nothing runs. The same bytes uploaded again (same ETag): still nothing.
    assert daemon.tick(s3_upload_sensor) == []
    bucket.put_object(Bucket=BUCKET, Key="incoming/labels.jsonl", Body=jsonl(rows(5)))
    assert daemon.tick(s3_upload_sensor) == []
    assert len(engine.calls) == 1

    # A changed object under the same key is a new batch.
    bucket.put_object(Bucket=BUCKET, Key="incoming/labels.jsonl", Body=jsonl(rows(3, prefix="v2-")))
    runs = daemon.until_delivered(s3_upload_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    second = runs[0][1]
    assert second != batch_id
    assert sorted(l["custom_id"] for l in s3_lines(bucket, f"results/{second}/output.jsonl")) == ["v2-0", "v2-1", "v2-2"]


def test_s3_cursor_survives_restarts_and_lists_incrementally(tmp_path, bucket):
    daemon = Daemon(tmp_path, fake_vllm("s3-inc", FakeEngine()), max_keys_per_tick=2, max_batches_per_tick=1)
    for i in range(4):
        bucket.put_object(Bucket=BUCKET, Key=f"incoming/f{i}.jsonl", Body=jsonl(rows(1, prefix=f"f{i}-")))
    launched = []
    for _ in range(4):
        launched += [b for job, b in daemon.tick(s3_upload_sensor, run=False) if job == "batch_job"]
        assert len(launched) == len(set(launched))
    assert len(launched) == 4  # one per tick: bounded work, the cursor moving through the bucket
    # A restarted daemon with no cursor lists from the top and finds nothing new: the store remembers.
    daemon.cursors.clear()
    for _ in range(3):
        assert daemon.tick(s3_upload_sensor, run=False) == []


def test_s3_sensor_is_off_without_a_bucket(tmp_path):
    daemon = Daemon(tmp_path, fake_vllm("s3-off", FakeEngine()), s3_bucket="")
    context = dg.build_sensor_context(instance=daemon.instance, resources=daemon.resources)
    result = s3_upload_sensor(context)
    assert isinstance(result, dg.SkipReason) and "BATCH_S3_BUCKET" in result.skip_message
    if not os.environ.get("BATCH_S3_BUCKET"):
        assert s3_upload_sensor.default_status == dg.DefaultSensorStatus.STOPPED
    assert inbox_sensor.default_status == dg.DefaultSensorStatus.RUNNING


def test_inbox_waits_for_a_file_to_be_completely_written(tmp_path):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("inbox", engine))
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    dropped = rows(6)
    whole = jsonl(dropped)
    path = inbox / "todo.jsonl"
    path.write_bytes(whole[: len(whole) // 2])  # half written, cut mid-line
    (inbox / "upload.jsonl.part").write_bytes(whole)  # a copy in progress under a temporary name
    (inbox / ".hidden.jsonl").write_bytes(whole)
    assert daemon.tick(inbox_sensor) == []  # first sight: not known to be complete
    with open(path, "ab") as f:
        f.write(whole[len(whole) // 2:])
    assert daemon.tick(inbox_sensor) == []  # it changed since: still being written
    runs = daemon.until_delivered(inbox_sensor)  # unchanged across two ticks: complete
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    batch_id = runs[0][1]
    results = tmp_path / "outbox" / batch_id
    assert sorted(p.name for p in results.iterdir()) == ["errors.jsonl", "output.jsonl", "summary.json"]
    out = [json.loads(l) for l in (results / "output.jsonl").read_text().splitlines()]
    assert sorted(l["custom_id"] for l in out) == sorted(r["custom_id"] for r in dropped)
    assert json.loads((results / "summary.json").read_text())["source"] == path.resolve().as_uri()
    assert daemon.tick(inbox_sensor) == []
    assert len(engine.calls) == 1
    [run] = daemon.instance.get_runs(dg.RunsFilter(job_name="batch_job", tags={"dagster/partition": batch_id}))
    assert {k: run.tags.get(k) for k in ("source", "filename", "input_uri", "requests")} == {
        "source": "inbox", "filename": "todo.jsonl", "input_uri": path.resolve().as_uri(), "requests": "6"}


def test_a_symbolic_link_in_the_inbox_is_never_followed(tmp_path, capfd):
    from batch_dagster.storage.transfer import fetch

    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("inbox-link", engine))
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "secret.jsonl"  # any file the daemon can read, valid batch lines here
    outside.parent.mkdir()
    outside.write_bytes(jsonl(rows(2)))
    (inbox / "secret.jsonl").symlink_to(outside)
    for _ in range(3):
        assert daemon.tick(inbox_sensor) == []
    assert engine.calls == [] and not list(daemon.data_dir.glob("batches/*"))
    said = [line for line in capfd.readouterr().err.splitlines() if "symbolic link" in line]  # the sensor's log
    assert len(said) == 1 and "secret.jsonl" in said[0]  # said once, with the reason, not on every tick
    # A file swapped for a link after the sensor took it is refused when the run fetches it.
    with pytest.raises(OSError):
        fetch((inbox / "secret.jsonl").absolute().as_uri(), tmp_path / "copy.jsonl", s3=lambda: None)
    assert not (tmp_path / "copy.jsonl").exists()


def test_with_api_keys_and_no_owner_named_the_drop_sensors_take_no_file_and_say_why(tmp_path):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("inbox-unowned", engine))
    daemon.resources["database"] = DatabaseResource(url=daemon.db_url, api_keys="sk-a,sk-b")  # and no intake key
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    (inbox / "todo.jsonl").write_bytes(jsonl(rows(2)))
    for sensor in (inbox_sensor, s3_upload_sensor):
        result = sensor(dg.build_sensor_context(instance=daemon.instance, resources=daemon.resources))
        assert isinstance(result, dg.SkipReason) and "BATCH_INTAKE_API_KEY" in result.skip_message
    assert engine.calls == [] and not list(daemon.data_dir.glob("batches/*"))


def test_dropped_files_runs_are_tagged_for_the_run_queue_by_their_model(tmp_path):
    FAKES["inbox-queue"] = FakeEngine()
    vllm = FakeVLLM(models_file=str(Settings.from_env().models_file), model_cache_dir="/nonexistent",
                    fake="inbox-queue", fleet_urls={CHAT_MODEL: "http://127.0.0.1:9"})
    daemon = Daemon(tmp_path, vllm)
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    embed = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBED_MODEL, "input": "x"}}
    (inbox / "chat.jsonl").write_bytes(jsonl(rows(1)).rstrip(b"\n"))  # its only line, with no newline, counts
    (inbox / "embed.jsonl").write_bytes(jsonl([embed]))
    daemon.tick(inbox_sensor, run=False)  # first sight
    assert len(daemon.tick(inbox_sensor, run=False)) == 2
    tags = {r.tags["filename"]: {k: v for k, v in r.tags.items() if k.startswith("batch/")} for r in daemon.requested}
    assert tags == {"chat.jsonl": {"batch/engine": "server", "batch/model": CHAT_MODEL},
                    "embed.jsonl": {"batch/engine": "offline", "batch/model": EMBED_MODEL}}


def test_an_invalid_dropped_file_gets_its_errors_beside_it(tmp_path):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("inbox-bad", engine))
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    (inbox / "bad.jsonl").write_bytes(jsonl([chat_request("a", "hi"), "{oops", chat_request("a", "again")]))
    daemon.tick(inbox_sensor)  # first sight
    runs = daemon.until_delivered(inbox_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    results = tmp_path / "outbox" / runs[0][1]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["files"] == []
    assert [(e["code"], e["line"]) for e in summary["errors"]] == [("invalid_json", 2), ("duplicate_custom_id", 3)]
    assert engine.calls == []


def test_configuration_from_the_environment(tmp_path, monkeypatch):
    from batch_dagster.db import repo
    from batch_dagster.defs.resources.setting_fields import from_settings
    from batch_dagster.settings import Settings

    def intake_from_env() -> Intake:  # as a sensor sees it: its fields resolved from their variables
        return from_settings(Intake, Settings.from_env()).process_config_and_initialize()

    monkeypatch.setenv("BATCH_DATA_DIR", str(tmp_path / "data"))
    for name in ("BATCH_S3_BUCKET", "BATCH_INBOX_DIR", "BATCH_OUTBOX_DIR", "BATCH_INTAKE_API_KEY", "BATCH_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    default = intake_from_env()
    assert (default.s3_bucket, default.s3_prefix, default.s3_output_prefix) == ("", "incoming/", "results/")
    assert Path(default.inbox_dir) == tmp_path / "data" / "inbox"
    assert Path(default.outbox_dir) == tmp_path / "data" / "outbox"

    def store() -> DatabaseResource:  # as a sensor sees it: the store resource's keys resolved from their variables
        return from_settings(DatabaseResource, Settings.from_env()).process_config_and_initialize()

    assert store().intake_owner() == repo.ANONYMOUS and store().no_intake_owner() is None
    monkeypatch.setenv("BATCH_API_KEYS", "sk-first,sk-second")
    # With keys, no key is picked to own dropped files (not the first one, silently): the owner is to be named.
    assert store().intake_owner() == "" and "BATCH_INTAKE_API_KEY" in store().no_intake_owner()
    monkeypatch.setenv("BATCH_API_KEYS", "ops:sk-first,sk-second")
    monkeypatch.setenv("BATCH_INTAKE_API_KEY", "sk-first")
    assert store().intake_owner() == repo.owner_of_key("sk-first")  # a named key: the same owner, by its key
    monkeypatch.setenv("BATCH_INTAKE_API_KEY", "sk-second")
    monkeypatch.setenv("BATCH_S3_BUCKET", "in")
    assert store().intake_owner() == repo.owner_of_key("sk-second")
    assert intake_from_env().s3_results_uri() == "s3://in/results/"
