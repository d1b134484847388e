"""No tenant's input stops the daemon's work for the others: each value is bounded where it comes in, and each
batch's sync and each dropped file's intake is its own transaction (rolled back and logged on error).

These run on SQLite here; tests/system/test_tenancy_postgres.py runs the same tests on a real PostgreSQL 15, which
enforces the column lengths SQLite ignores.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from sqlalchemy import select

from batch_dagster.batchfile.contract import CHAT, MAX_FILENAME_CHARS, MAX_MODEL_CHARS, BatchError
from batch_dagster.batchfile.folder import Validation
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.db.batches import add_input_file, create_batch
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource
from batch_dagster.defs.sensors import api_batch_status_sensor, api_batches, inbox_sensor, s3_upload_sensor
from tests.helpers import BUCKET, Daemon, FakeEngine, chat_request, fake_vllm, jsonl, rows, write_jsonl

LONG_MODEL = "m" * (MAX_MODEL_CHARS + 45)


@pytest.fixture
def db_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'api.db'}"


@pytest.fixture
def store(db_url):
    database = Database(db_url)
    database.upgrade()
    yield database
    database.dispose()


def _launched(session, owner: str) -> str:
    repo.ensure_owners(session, [owner])
    batch = BatchRecord(id=repo.new_batch_id(), owner=owner, endpoint=CHAT, input_file_id="file-x",
                        completion_window="24h", status="validating", created_at=repo.now(), launched_at=repo.now())
    session.add(batch)
    session.commit()
    return batch.id


def test_one_batch_that_cannot_be_synced_stops_no_other(store, db_url, tmp_path, monkeypatch):
    storage = StorageResource(data_dir=str(tmp_path / "data"))
    folders = storage.open()
    with store.session() as session:
        plain, long_model, broken, last = (_launched(session, owner) for owner in ("a", "b", "b", "a"))
    invalid = [BatchError("invalid_json", "The line is not valid JSON.", line=1)]
    for batch_id, model, valid in ((plain, "m", False), (long_model, LONG_MODEL, False), (broken, "m", True),
                                   (last, "m", False)):
        # A document holding a model longer than its column: PostgreSQL refuses the UPDATE that copies it.
        storage.folder(batch_id).write_validation(Validation(valid, 1, model, CHAT, 0 if valid else 1,
                                                             [] if valid else invalid))
    with dg.instance_for_test() as instance:
        for batch_id in (plain, long_model, broken, last):
            status = dg.DagsterRunStatus.FAILURE if batch_id == broken else dg.DagsterRunStatus.STARTED
            instance.add_run(dg.DagsterRun(job_name="batch_job", status=status, tags={"dagster/partition": batch_id}))
        real_message = api_batches.run_failure_message

        def failing(instance, run):  # the store or the instance failing at one batch
            if run.tags.get("dagster/partition") == broken:
                raise RuntimeError("event log unreachable")
            return real_message(instance, run)

        monkeypatch.setattr(api_batches, "run_failure_message", failing)
        resources = {"database": DatabaseResource(url=db_url), "storage": storage, "pipeline": PipelineConfig()}
        result = api_batch_status_sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert result.skip_message == "3 batch(es) changed status."
        with store.session() as session:
            stored = {b.id: b for b in session.scalars(select(BatchRecord))}
        assert {k: stored[k].status for k in (plain, long_model, last)} == dict.fromkeys((plain, long_model, last),
                                                                                          "failed")
        assert stored[long_model].model is None and stored[plain].model == "m"
        assert stored[broken].status == "in_progress"  # its first change is kept; the failed one is rolled back
        # Next tick, the failure gone: the broken batch ends too, the others are not touched again.
        monkeypatch.setattr(api_batches, "run_failure_message", real_message)
        result = api_batch_status_sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert result.skip_message == "1 batch(es) changed status."
        with store.session() as session:
            ended = session.scalar(select(BatchRecord).where(BatchRecord.id == broken))
            assert ended.status == "failed" and ended.errors[0]["code"] == "pipeline_error"
    assert folders.exists(f"batches/{plain}/validation.json")


def test_a_model_too_long_for_the_store_is_not_recorded_at_creation(store, tmp_path):
    storage = StorageResource(data_dir=str(tmp_path / "data")).open()
    path = write_jsonl(tmp_path / "in.jsonl", [chat_request("a", "hi", model=LONG_MODEL)])
    with store.session() as session:
        upload = add_input_file(session, owner="a", file_id=repo.new_file_id(), filename="in.jsonl",
                                size=path.stat().st_size)
        batch = create_batch(session, storage, BatchRequest(owner="a", input_file_id=upload.id, endpoint=CHAT), path)
        session.commit()
        assert batch.model is None  # validation then fails the file: line 1, body.model
    with store.session() as session:
        assert session.scalar(select(BatchRecord.model).where(BatchRecord.id == batch.id)) is None


def _inbox_daemon(tmp_path: Path, db_url: str, name: str) -> tuple[Daemon, Path]:
    # A deep inbox: its own files' URIs are within the store's 1,024 characters, one with a long name is not.
    inbox = tmp_path.joinpath(*["d" * 150] * 5)
    daemon = Daemon(tmp_path, fake_vllm(name, FakeEngine()), db_url=db_url, inbox_dir=str(inbox))
    inbox.mkdir(parents=True)
    return daemon, inbox


def test_a_dropped_file_whose_name_does_not_fit_is_refused_and_the_others_run(tmp_path, db_url):
    daemon, inbox = _inbox_daemon(tmp_path, db_url, "inbox-long")
    (inbox / "ok.jsonl").write_bytes(jsonl(rows(2)))
    long_name = "n" * 240 + ".jsonl"
    (inbox / long_name).write_bytes(jsonl(rows(2)))
    assert len((inbox / long_name).resolve().as_uri()) > 1024 > len((inbox / "ok.jsonl").resolve().as_uri())
    assert daemon.tick(inbox_sensor, run=False) == []  # first sight
    [(job, batch_id)] = daemon.tick(inbox_sensor, run=False)
    assert job == "batch_job"
    refused = json.loads(daemon.cursors["inbox_sensor"])["refused"]
    assert len(refused) == 1
    assert daemon.tick(inbox_sensor, run=False) == []  # refused once, remembered: no batch, no new entry
    assert json.loads(daemon.cursors["inbox_sensor"])["refused"] == refused
    with Database(daemon.db_url).session() as session:
        assert list(session.scalars(select(BatchRecord.id))) == [batch_id]
    assert sorted(p.name for p in (daemon.data_dir / "batches").iterdir()) == [batch_id]


def test_a_drop_the_store_refuses_is_rolled_back_and_the_next_file_still_registers(tmp_path, db_url, monkeypatch):
    daemon, inbox = _inbox_daemon(tmp_path, db_url, "inbox-fail")
    for name in ("a.jsonl", "b.jsonl"):
        (inbox / name).write_bytes(jsonl(rows(1)))
    from batch_dagster.db import batches as store_batches

    real = store_batches.IntakeRecord

    def refusing(**kwargs):  # the store refusing one file's intake row, after its File and Batch rows were added
        if kwargs["source"].endswith("/a.jsonl"):
            raise RuntimeError("the store refused the row")
        return real(**kwargs)

    monkeypatch.setattr(store_batches, "IntakeRecord", refusing)
    daemon.tick(inbox_sensor, run=False)
    [(_, b)] = daemon.tick(inbox_sensor, run=False)
    with Database(daemon.db_url).session() as session:
        # Nothing of a.jsonl stayed: no File, no Batch, no folder; b.jsonl is a batch.
        assert list(session.scalars(select(BatchRecord.id))) == [b]
        assert [f.filename for f in session.scalars(select(FileRecord))] == ["b.jsonl"]
    assert [p.name for p in (daemon.data_dir / "batches").iterdir()] == [b]
    monkeypatch.setattr(store_batches, "IntakeRecord", real)
    [(_, a)] = daemon.tick(inbox_sensor, run=False)  # tried again: now it registers
    assert a != b


def test_s3_keys_long_names_are_cut_and_too_long_keys_refused(tmp_path, db_url, bucket):
    daemon = Daemon(tmp_path, fake_vllm("s3-long", FakeEngine()), db_url=db_url)
    # S3 takes keys up to 1,024 bytes; with the bucket's name the last one's URI is longer than the store keeps.
    for name in ("ok.jsonl", "n" * 600 + ".jsonl", "k" * 1009 + ".jsonl"):
        bucket.put_object(Bucket=BUCKET, Key=f"incoming/{name}", Body=jsonl(rows(1)))
    requested = daemon.tick(s3_upload_sensor, run=False)
    assert len(requested) == 2
    with Database(daemon.db_url).session() as session:
        names = sorted(len(f.filename) for f in session.scalars(select(FileRecord)))
    assert names == [len("ok.jsonl"), MAX_FILENAME_CHARS]
    assert len(json.loads(daemon.cursors["s3_upload_sensor"])["refused"]) == 1
    assert daemon.tick(s3_upload_sensor, run=False) == []


def test_a_step_failure_is_quoted_short_in_the_batch_errors():
    @dg.op
    def echoes_its_input():
        raise ValueError("bad value: " + "x" * 100_000)

    @dg.job
    def failing():
        echoes_its_input()

    with dg.instance_for_test() as instance:
        result = failing.execute_in_process(instance=instance, raise_on_error=False)
        run = instance.get_run_by_id(result.run_id)
        message = api_batches.run_failure_message(instance, run)
    assert message.startswith("The pipeline failed in step echoes_its_input: ValueError: bad value: xxx")
    assert len(message) < api_batches.MAX_FAILURE_CHARS + 200
