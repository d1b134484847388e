"""Retention at a reduced volume: 300 batches over 60 days in PostgreSQL 15, their Dagster history in a real instance.

The history is recorded directly (a run, a materialization and step logs per batch) rather than run: what is under
test is which batches the retention pass picks, in bounded ticks, and that it deletes those and nothing else.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

import dagster as dg
from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.defs import retention
from batch_dagster.defs.resources import DatabaseResource, StorageResource
from batch_dagster.defs.retention import Retention, history_retention_sensor
from batch_dagster.settings import DAY_S

N = 300
STATUSES = ("completed", "failed", "expired", "cancelled", "in_progress")


def _record_history(instance: dg.DagsterInstance, batch_id: str, *, finished: bool) -> str:
    run_id = str(uuid.uuid4())
    status = dg.DagsterRunStatus.SUCCESS if finished else dg.DagsterRunStatus.STARTED
    instance.add_run(dg.DagsterRun(job_name="batch_job", run_id=run_id, status=status,
                                   tags={"dagster/partition": batch_id}))
    materialization = dg.AssetMaterialization(asset_key="batch_usage", partition=batch_id)
    instance.report_dagster_event(DagsterEvent(DagsterEventType.ASSET_MATERIALIZATION.value, job_name="batch_job",
                                               event_specific_data=StepMaterializationData(materialization)), run_id)
    logs = Path(instance.root_directory) / "storage" / run_id / "compute_logs"
    logs.mkdir(parents=True)
    (logs / "batch_usage.err").write_text("step log")
    return run_id


def _folder_files(root: Path, batch_id: str) -> set[str]:
    folder = root / "batches" / batch_id
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_retention_at_volume_deletes_the_old_batches_history_and_nothing_else(postgres_url, tmp_path, monkeypatch):
    monkeypatch.setattr(retention, "BATCHES_PER_TICK", 50)  # the backlog takes several ticks, each from the cursor
    database = Database(postgres_url)
    database.upgrade()
    data = tmp_path / "data"
    storage = StorageResource(data_dir=str(data))
    now = repo.now()
    cutoff = now - Retention().history_retention_s
    ended = {f"batch_v{i:03d}": (STATUSES[i % len(STATUSES)], now - (i % 60) * DAY_S - 3600) for i in range(N)}
    old = {b for b, (status, at) in ended.items() if status in TERMINAL and at <= cutoff}
    stuck = sorted(old)[0]  # past retention, but a run of it has not finished: left whole
    with database.session() as session:
        repo.ensure_owners(session, ["a"])
        for n, (batch_id, (status, at)) in enumerate(ended.items()):
            stamp = {f"{status}_at": at} if status in TERMINAL else {"in_progress_at": at}
            session.add(BatchRecord(id=batch_id, owner="a", endpoint="/v1/chat/completions", input_file_id="file-v",
                                    completion_window="24h", status=status, created_at=at - 600, **stamp))
            folder = BatchFolder(storage.open(), batch_id)
            for name in ("requests.parquet", "shards/shard-00000.parquet", "results/shard-00000.json",
                         "summary.json", "output.jsonl"):
                folder.storage.write_bytes(folder.key(name), b"{}")
            if n % 2:  # half the batches' output files are still served
                session.add(FileRecord(id=f"file-{batch_id}", owner="a", bytes=2, created_at=at, expires_at=None,
                                       filename="out.jsonl", purpose="batch_output", path=folder.output_key,
                                       batch_id=batch_id))
        session.commit()
    served = {b for n, b in enumerate(ended) if n % 2}
    folders_before = {b: _folder_files(data, b) for b in ended}

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("batches", list(ended))
        runs = {b: _record_history(instance, b, finished=b != stuck) for b in ended}
        resources = {"database": DatabaseResource(url=postgres_url), "storage": storage, "retention": Retention()}
        cursor, ticks, started = None, 0, time.monotonic()
        while True:
            context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources)
            message = history_retention_sensor(context).skip_message
            cursor, ticks = context.cursor, ticks + 1
            if message.startswith("0 batch(es)"):
                break
            assert ticks <= N, message
        elapsed = time.monotonic() - started
        print(f"{len(old)} batches past retention deleted in {ticks} ticks, {elapsed:.1f} s")

        gone = old - {stuck}
        kept = set(ended) - gone
        assert 100 < len(gone) < 200 and len(kept) > 100
        assert ticks == math.ceil(len(old) / 50) + 1 >= 3, (ticks, elapsed)
        assert set(instance.get_dynamic_partitions("batches")) == kept
        assert {b for b, run_id in runs.items() if instance.get_run_by_id(run_id) is not None} == kept
        assert instance.get_materialized_partitions(dg.AssetKey("batch_usage")) == kept
        logs = Path(instance.root_directory) / "storage"
        assert {b for b, run_id in runs.items() if (logs / run_id).exists()} == kept
        for batch_id in ended:
            files = _folder_files(data, batch_id)
            if batch_id in gone:
                assert files == {"summary.json"} | ({"output.jsonl"} if batch_id in served else set()), batch_id
            else:
                assert files == folders_before[batch_id], batch_id
    with database.session() as session:  # every row stays, as it was
        rows = {b.id: (b.status, getattr(b, f"{b.status}_at")) for b in session.query(BatchRecord)}
    assert rows == ended
    database.dispose()


def test_a_batchs_history_is_deleted_from_a_postgres_instance(tmp_path, data_dir, postgres_url, monkeypatch):
    """On dagster-postgres' storage, the run, every event and check result of it, and the partition go."""
    import os
    import subprocess
    import sys

    import psycopg2

    from batch_dagster.defs.retention import purge_history
    from batch_dagster.defs.runner import run_batch
    from tests.helpers import FakeEngine, fake_vllm, make_defs, rows, write_jsonl

    home = tmp_path / "dagster_home"
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_PG_URL": postgres_url}
    subprocess.run([str(Path(sys.executable).with_name("batch-dagster")), "instance"], env=env, check=True,
                   capture_output=True)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("DAGSTER_PG_URL", postgres_url)

    def count(cur, sql: str, *args) -> int:
        cur.execute(sql, args)
        return cur.fetchone()[0]

    with dg.DagsterInstance.get() as instance:
        defs = make_defs(data_dir, fake_vllm("postgres-retention", FakeEngine()), shard_size=2)
        batch_id = run_batch(write_jsonl(tmp_path / "in.jsonl", rows(4)), tmp_path / "out", show_progress=False,
                             defs=defs, instance=instance).to_dict()["batch_id"]
        with psycopg2.connect(postgres_url.replace("+psycopg2", "")) as conn, conn.cursor() as cur:
            cur.execute("SELECT run_id FROM runs")
            (run_id,) = [row[0] for row in cur.fetchall()]
            assert (home / "storage" / run_id).is_dir()  # its step logs
            assert count(cur, "SELECT count(*) FROM event_logs WHERE run_id = %s", run_id) > 10
            assert count(cur, "SELECT count(*) FROM asset_check_executions WHERE run_id = %s", run_id) > 0
        assert purge_history(instance, batch_id)
        with psycopg2.connect(postgres_url.replace("+psycopg2", "")) as conn, conn.cursor() as cur:
            assert count(cur, "SELECT count(*) FROM runs") == 0
            assert count(cur, "SELECT count(*) FROM run_tags WHERE run_id = %s", run_id) == 0
            assert count(cur, "SELECT count(*) FROM event_logs WHERE run_id = %s", run_id) == 0
            assert count(cur, "SELECT count(*) FROM asset_check_executions WHERE run_id = %s", run_id) == 0
            assert count(cur, "SELECT count(*) FROM dynamic_partitions WHERE partition = %s", batch_id) == 0
        assert not (home / "storage" / run_id).exists()
