"""The Dagster instance on a real PostgreSQL 15: `batch-dagster instance` writes it, a batch's run lands there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import psycopg2
import pytest

from batch_dagster.defs.instance import INSTANCE_CONFIG
from batch_dagster.defs.runner import run_batch
from tests.helpers import MODEL_CACHE, FakeEngine, fake_vllm, make_defs, read_jsonl, rows, write_jsonl

CLI = Path(sys.executable).with_name("batch-dagster")


def test_instance_on_postgres_holds_the_batch_run(tmp_path, data_dir, postgres_url, monkeypatch):
    home = tmp_path / "dagster_home"
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_PG_URL": postgres_url}
    done = subprocess.run([str(CLI), "instance"], env=env, capture_output=True, text=True, check=True)
    assert "storage=postgres" in done.stdout
    config = home / "dagster.yaml"
    # Written, not linked (the package's file stays SQLite); the URL itself stays out of the file.
    assert not config.is_symlink()
    assert INSTANCE_CONFIG.read_text().strip() in config.read_text()
    assert "env: DAGSTER_PG_URL" in config.read_text() and postgres_url not in config.read_text()

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("DAGSTER_PG_URL", postgres_url)
    batch = rows(5)
    with dg.DagsterInstance.get() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        defs = make_defs(data_dir, fake_vllm("postgres", FakeEngine()), shard_size=2)
        summary = run_batch(write_jsonl(tmp_path / "in.jsonl", batch), tmp_path / "out", show_progress=False,
                            defs=defs, instance=instance).to_dict()
    assert summary["status"] == "completed"
    assert len(read_jsonl(tmp_path / "out" / "output.jsonl")) == len(batch)

    with psycopg2.connect(postgres_url.replace("+psycopg2", "")) as conn, conn.cursor() as cur:
        cur.execute("SELECT run_id, status FROM runs")
        runs = cur.fetchall()
        cur.execute("SELECT DISTINCT asset_key FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
        materialized = {row[0] for row in cur.fetchall()}
        cur.execute("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'batches'")
        partitions = [row[0] for row in cur.fetchall()]
    assert [status for _, status in runs] == ["SUCCESS"]
    for key in ("batch_input", "validated_requests", "batch_shards", "shard_results", "batch_output_files",
                "batch_usage"):
        assert dg.AssetKey(key).to_string() in materialized, key
    assert partitions == [summary["batch_id"]]
    # Nothing went to Dagster's SQLite files under DAGSTER_HOME.
    sqlite_files = [p for p in home.rglob("*.db")]
    if sqlite_files:
        pytest.fail(f"SQLite storage under DAGSTER_HOME: {sqlite_files}")


@pytest.mark.engine
def test_batch_dagster_run_with_the_url_in_the_form_dagsters_docs_use(tmp_path, postgres_url):
    """`DAGSTER_PG_URL=postgresql://...` (no driver named): the run normalizes it and its run lands on Postgres
    (it used to die in psycopg 3's `syntax error at or near "$1"`). The real engine, 2 requests."""
    plain = postgres_url.replace("postgresql+psycopg2://", "postgresql://")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_PG_URL": plain,
           "BATCH_DATA_DIR": str(tmp_path / "data"), "BATCH_MODEL_CACHE": str(MODEL_CACHE)}
    batch = rows(2, max_tokens=4)
    proc = subprocess.run([str(CLI), "run", str(write_jsonl(tmp_path / "in.jsonl", batch)), "--out",
                           str(tmp_path / "out"), "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["status"] == "completed"
    assert len(read_jsonl(tmp_path / "out" / "output.jsonl")) == 2
    config = (tmp_path / "home" / "dagster.yaml").read_text()
    assert "env: DAGSTER_PG_URL" in config and "postgres@" not in config
    with psycopg2.connect(plain) as conn, conn.cursor() as cur:
        cur.execute("SELECT status FROM runs")
        assert [status for (status,) in cur.fetchall()] == ["SUCCESS"]
