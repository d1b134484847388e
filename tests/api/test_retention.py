"""History retention: batches that ended long enough ago lose their Dagster history and working files, nothing else."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace
from datetime import UTC, date, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import dagster as dg
import openai
import pytest
from sqlalchemy import update

from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.defs import retention as retention_sensor
from batch_dagster.defs.partitions import report_start
from batch_dagster.defs.retention import Retention, history_retention_sensor
from batch_dagster.defs.sensors import file_expiry_sensor
from batch_dagster.features.retention import first_batch_created_at
from batch_dagster.settings import DAY_S, Settings
from tests.helpers import BUCKET, check_retention_queries, rows, upload, wait_for

CHAT = "/v1/chat/completions"
EXPIRING = {"anchor": "created_at", "seconds": 3600}


def _runs(instance: dg.DagsterInstance, batch_id: str) -> list[dg.DagsterRun]:
    return list(instance.get_runs(dg.RunsFilter(tags={"dagster/partition": batch_id})))


def _folder(data_dir: Path, batch_id: str) -> set[str]:
    root = data_dir / "batches" / batch_id
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _run_db(instance: dg.DagsterInstance, run_id: str) -> Path:
    """The run's own event-log database (SQLite event-log storage keeps one per run)."""
    return Path(instance.event_log_storage.path_for_shard(run_id))  # type: ignore[attr-defined]


def _history(instance: dg.DagsterInstance, data_dir: Path, batch_id: str) -> dict:
    """What Dagster and the folder hold of a batch: partition, runs, events, check results, step logs, run databases,
    files."""
    storage = Path(instance.root_directory) / "storage"
    runs = [r.run_id for r in _runs(instance, batch_id)]
    check = dg.AssetCheckKey(dg.AssetKey("validated_requests"), "unique_custom_ids")
    checked = instance.event_log_storage.get_asset_check_execution_history(check, limit=100)
    return {
        "checks": [c.run_id for c in checked if c.run_id in runs],
        "partition": instance.has_dynamic_partition("batches", batch_id),
        "runs": runs,
        "events": sum(len(instance.all_logs(run_id)) for run_id in runs),
        "step_logs": [run_id for run_id in runs if (storage / run_id / "compute_logs").is_dir()],
        "run_dbs": [run_id for run_id in runs if _run_db(instance, run_id).exists()],
        "folder": _folder(data_dir, batch_id),
    }


def _tick(service, cursor: str | None = None) -> tuple[str, str | None]:
    context = dg.build_sensor_context(instance=service.instance, cursor=cursor,
                                      resources={**service.worker.resources, "retention": Retention()})
    result = history_retention_sensor(context)
    return result.skip_message, context.cursor


def test_retention_deletes_the_history_of_old_batches_and_nothing_else(start_service, tmp_path, monkeypatch):
    # Its runs keep their step logs and their event-log databases (one per run, on disk), to be deleted.
    service = start_service(shard_size=2, step_logs=True, events_on_disk=True)
    client = service.client()
    ids = {}
    for name, expires in (("old_expiring", EXPIRING), ("old_kept", None), ("recent", None)):
        file_id = upload(client, tmp_path / f"{name}.jsonl", rows(3, max_tokens=4))
        extra = {"output_expires_after": expires} if expires else {}
        ids[name] = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", **extra).id
    done = {name: wait_for(client, batch_id, "completed") for name, batch_id in ids.items()}
    service.worker.stopping.set()
    service.worker.join(60)
    instance, data_dir = service.instance, service.data_dir

    before = {name: _history(instance, data_dir, batch_id) for name, batch_id in ids.items()}
    for name, history in before.items():  # everything the retention pass is to delete is there to begin with
        assert history["partition"] and history["runs"] and history["events"] > 10, name
        assert history["step_logs"] == history["run_dbs"] == history["checks"] == history["runs"], name
        assert {"requests.parquet", "shards/manifest.json", "summary.json", "output.jsonl"} <= history["folder"]

    # The two old batches ended 31 days ago; the expiring one's output files expired then too, and go first.
    month_ago = int(time.time()) - 31 * DAY_S
    store = Database(service.config.database_url)
    with store.session() as session:
        old = [ids["old_expiring"], ids["old_kept"]]
        session.execute(update(BatchRecord).where(BatchRecord.id.in_(old)).values(completed_at=month_ago))
        session.execute(update(FileRecord).where(FileRecord.batch_id == ids["old_expiring"])
                        .values(expires_at=month_ago))
        session.commit()
    store.dispose()
    context = dg.build_sensor_context(instance=instance, resources=service.worker.resources)
    assert file_expiry_sensor(context).skip_message == "2 expired file(s) deleted."

    # One batch per tick here: a backlog is worked off over several ticks, each resuming at the cursor.
    monkeypatch.setattr(retention_sensor, "BATCHES_PER_TICK", 1)
    message, cursor = _tick(service)
    assert message.startswith("1 batch(es) past retention or the partition bound deleted")
    assert json.loads(cursor or "{}")["ended_at"] == month_ago
    message, cursor = _tick(service, cursor)
    assert message.startswith("1 batch(es) past retention or the partition bound deleted")
    assert _tick(service, cursor)[0].startswith("0 batch(es)")
    monkeypatch.setattr(retention_sensor, "BATCHES_PER_TICK", 200)
    assert _tick(service)[0].startswith("2 batch(es)")  # a lost cursor: the same deletes again, all no-ops

    after = {name: _history(instance, data_dir, batch_id) for name, batch_id in ids.items()}
    for name in ("old_expiring", "old_kept"):
        history = after[name]
        assert not history["partition"] and history["runs"] == [], name
        check = dg.AssetCheckKey(dg.AssetKey("validated_requests"), "unique_custom_ids")
        checked = {c.run_id for c in instance.event_log_storage.get_asset_check_execution_history(check, limit=100)}
        assert not checked & set(before[name]["runs"])
        storage = Path(instance.root_directory) / "storage"
        for run_id in before[name]["runs"]:
            assert instance.get_run_by_id(run_id) is None
            assert not (storage / run_id).exists() and not _run_db(instance, run_id).exists()
    # What stays of an old batch: its summary (the daily report prices it by it) and the files the API still serves.
    assert after["old_expiring"]["folder"] == {"summary.json"}
    assert after["old_kept"]["folder"] == {"summary.json", "output.jsonl", "errors.jsonl"}
    assert after["recent"] == before["recent"]
    assert instance.get_dynamic_partitions("batches") == [ids["recent"]]
    materialized = instance.get_materialized_partitions(dg.AssetKey("batch_usage"))
    assert materialized == {ids["recent"]}
    records = instance.fetch_materializations(dg.AssetKey("batch_usage"), limit=100).records
    assert {r.run_id for r in records} == set(before["recent"]["runs"])

    # The API still answers for every batch, as it was; only the expired files are gone.
    for name, batch_id in ids.items():
        batch = client.batches.retrieve(batch_id)
        assert batch.status == "completed" and batch.request_counts == done[name].request_counts, name
        assert batch.output_file_id == done[name].output_file_id
    with pytest.raises(openai.NotFoundError):
        client.files.content(done["old_expiring"].output_file_id)
    kept = client.files.content(done["old_kept"].output_file_id).text
    assert len(kept.splitlines()) == 3
    assert ids["old_kept"] in {b.id for b in client.batches.list()}
    # Its requests are gone: a retry says so, not that its requests cannot be retried.
    with pytest.raises(openai.BadRequestError) as refused:
        client.post(f"/batches/{ids['old_kept']}/retry", cast_to=openai.types.Batch)
    assert "can no longer be retried: its files were deleted" in refused.value.message, refused.value.message


def test_retention_sweeps_old_scratch_and_can_keep_history_for_ever(start_service):
    service = start_service(worker=False)
    scratch = service.storage.scratch_dir
    (scratch / "tmpdir").mkdir(parents=True)
    for name in ("tmpold-requests.parquet", "tmpdir/part", "tmpnew-output.jsonl"):
        (scratch / name).write_bytes(b"x")
    old = time.time() - 2 * DAY_S
    for name in ("tmpold-requests.parquet", "tmpdir/part", "tmpdir"):
        os.utime(scratch / name, (old, old))
    context = dg.build_sensor_context(instance=service.instance,
                                      resources={**service.worker.resources,
                                                 "retention": Retention(history_retention_s=0)})
    assert history_retention_sensor(context).skip_message == (
        "History is kept (no batch past retention, partitions within the bound); 2 leftover(s) swept.")
    assert sorted(p.name for p in scratch.iterdir()) == ["tmpnew-output.jsonl"]


def test_past_the_partition_bound_the_batches_that_ended_first_lose_their_history(start_service, tmp_path):
    """BATCH_HISTORY_MAX_BATCHES: however recent, the batches that ended first go until the bound holds; a batch
    not ended keeps its partition; every row and served file stays."""
    service = start_service()
    client = service.client()
    ids = []
    for n in range(3):
        file_id = upload(client, tmp_path / f"b{n}.jsonl", rows(2))
        ids.append(client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id)
    done = [wait_for(client, batch_id, "completed") for batch_id in ids]
    service.worker.stopping.set()
    service.worker.join(60)
    store = Database(service.config.database_url)
    with store.session() as session:  # ended in the order 1, 0, 2, a second apart, all of it recent
        for batch_id, at in zip(ids, (10, 5, 20), strict=True):
            session.execute(update(BatchRecord).where(BatchRecord.id == batch_id)
                            .values(completed_at=int(time.time()) - 100 + at))
        session.commit()
    store.dispose()
    service.instance.add_dynamic_partitions("batches", ["batch_not_ended"])  # a run still going: never purged
    context = dg.build_sensor_context(instance=service.instance, resources={
        **service.worker.resources, "retention": Retention(history_retention_s=0, history_max_batches=2)})
    assert history_retention_sensor(context).skip_message.startswith("2 batch(es) past retention or the partition")
    assert sorted(service.instance.get_dynamic_partitions("batches")) == sorted(["batch_not_ended", ids[2]])
    assert _runs(service.instance, ids[1]) == [] and _runs(service.instance, ids[2])
    for batch_id, before in zip(ids, done, strict=True):  # the API answers as before, files and all
        assert client.batches.retrieve(batch_id).request_counts == before.request_counts
        assert len(client.files.content(before.output_file_id).text.splitlines()) == 2


def test_retention_queries_on_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'api.db'}"
    assert first_batch_created_at(url) is None and not (tmp_path / "api.db").exists()  # read, never created
    store = Database(url)
    store.upgrade()
    try:
        check_retention_queries(store)
        assert first_batch_created_at(url) == 10
    finally:
        store.dispose()


def test_the_daily_report_starts_at_the_setting_else_the_first_batch_else_today(tmp_path):
    url = f"sqlite:///{tmp_path / 'api.db'}"
    settings = replace(Settings.from_env(), database_url=url, report_start=None)
    today = datetime.now(UTC).date()
    assert report_start(settings) == today  # no store yet
    store = Database(url)
    store.upgrade()
    assert report_start(settings) == today  # a store without a batch
    first = int(datetime(2026, 5, 6, 23, 59, tzinfo=UTC).timestamp())
    with store.session() as session:
        repo.ensure_owners(session, ["a"])
        session.add_all(BatchRecord(id=f"batch_{n}", owner="a", endpoint=CHAT, input_file_id="file-x",
                                    completion_window="24h", status="completed", created_at=first + n * DAY_S)
                        for n in (0, 1))
        session.commit()
    store.dispose()
    assert report_start(settings) == date(2026, 5, 6)  # the UTC day of the first batch
    assert report_start(replace(settings, report_start=date(2026, 2, 1))) == date(2026, 2, 1)
    assert report_start(replace(settings, database_url="postgresql+psycopg://nobody@127.0.0.1:1/none")) == today


class _Runs:
    """An instance as sweep_staged_logs sees it: a cloud compute log manager (its local staging manager) and runs."""

    def __init__(self, staging: Path, runs: dict):
        from dagster._core.storage.local_compute_log_manager import LocalComputeLogManager

        self.compute_log_manager = type("CloudLogs", (), {"local_manager": LocalComputeLogManager(str(staging))})()
        self.runs = runs

    def get_run_by_id(self, run_id: str):
        return self.runs.get(run_id)


def test_staged_step_logs_of_finished_or_gone_runs_are_swept(tmp_path):
    finished, running, gone, fresh = (str(uuid.uuid4()) for _ in range(4))
    for run_id in (finished, running, gone, fresh):
        (tmp_path / run_id / "compute_logs").mkdir(parents=True)
        (tmp_path / run_id / "compute_logs" / "step.err").write_text("staged")
    (tmp_path / "other").mkdir()  # not a run's: the staging folder is /tmp by default
    old = time.time() - 2 * DAY_S
    for run_id in (finished, running, gone):
        for path in (tmp_path / run_id).rglob("*"):
            os.utime(path, (old, old))
        os.utime(tmp_path / run_id, (old, old))
    os.utime(tmp_path / "other", (old, old))
    runs = {finished: SimpleNamespace(is_finished=True), running: SimpleNamespace(is_finished=False),
            fresh: SimpleNamespace(is_finished=True)}
    instance = cast(dg.DagsterInstance, _Runs(tmp_path, runs))
    assert retention_sensor.sweep_staged_logs(instance, time.time() - DAY_S) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running, fresh, "other"])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_clearing_a_folder_keeps_its_summary_and_the_served_files_only(where, tmp_path, request):
    from batch_dagster.batchfile.folder import BatchFolder
    from batch_dagster.storage import open_storage

    if where == "s3":
        request.getfixturevalue("bucket")
    storage = open_storage(f"s3://{BUCKET}/tenant" if where == "s3" else str(tmp_path / "store"), tmp_path / "scratch")
    folder, other = BatchFolder(storage, "batch_1"), BatchFolder(storage, "batch_10")
    names = ["input.jsonl", "requests.parquet", "shards/shard-00000.parquet", "shards/manifest.json",
             "results/shard-00000.json", "delivery/summary.json", "output.jsonl", "errors.jsonl", "summary.json"]
    for name in names:
        storage.write_bytes(folder.key(name), b"{}")
        storage.write_bytes(other.key(name), b"{}")
    folder.clear(keep={folder.output_key})
    folder.clear(keep={folder.output_key})  # again: nothing more to delete, no error

    def listing(f: BatchFolder) -> set[str]:
        subs = storage.list_folders(f.prefix)
        return {*storage.list(f.prefix), *(k for s in subs for k in storage.list(s))}

    assert listing(folder) == {folder.summary_key, folder.output_key}
    assert listing(other) == {other.key(n) for n in names}  # a folder whose name starts the same is not touched


def test_a_failed_delete_stops_the_tick_where_it_failed_and_the_next_tick_resumes_there(start_service, monkeypatch):
    service = start_service(worker=False)
    store = Database(service.config.database_url)
    with store.session() as session:
        repo.ensure_owners(session, ["a"])
        session.add_all(BatchRecord(id=f"batch_f{n}", owner="a", endpoint=CHAT, input_file_id="file-x",
                                    completion_window="24h", status="completed", created_at=0, completed_at=n)
                        for n in (1, 2, 3))
        session.commit()
    store.dispose()
    service.instance.add_dynamic_partitions("batches", ["batch_f1", "batch_f2", "batch_f3"])
    purge = retention_sensor.purge_history

    def unreachable_once(instance, batch_id):
        if batch_id == "batch_f2" and not failed:
            failed.append(batch_id)
            raise ConnectionError("the storage is unreachable")
        return purge(instance, batch_id)

    failed: list[str] = []
    monkeypatch.setattr(retention_sensor, "purge_history", unreachable_once)
    message, cursor = _tick(service)
    assert message.startswith("1 batch(es)") and json.loads(cursor or "{}")["ended_at"] == 1
    assert service.instance.get_dynamic_partitions("batches") == ["batch_f2", "batch_f3"]
    message, cursor = _tick(service, cursor)
    assert message.startswith("2 batch(es)") and service.instance.get_dynamic_partitions("batches") == []
