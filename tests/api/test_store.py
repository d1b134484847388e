"""The store: migrations that match the models (and render for Postgres), paging, status transitions."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from batch_dagster.batchfile.contract import BatchError, RequestCounts
from batch_dagster.batchfile.folder import BatchFolder, Manifest, Validation
from batch_dagster.db import TERMINAL, BatchRecord, Database, FileRecord, repo
from batch_dagster.db.lifecycle import Observation, apply, changes, observe, run_failed
from batch_dagster.db.models import Base
from batch_dagster.db.session import alembic_config
from batch_dagster.features import webhooks
from batch_dagster.storage import LocalStorage
from tests.helpers import check_batch_filters


@pytest.fixture
def store(tmp_path):
    s = Database(f"sqlite:///{tmp_path / 'store.db'}")
    s.upgrade()
    yield s
    s.dispose()


def test_migrations_build_exactly_the_models(store):
    store.upgrade()  # idempotent
    with store.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        assert set(inspect(connection).get_table_names()) >= {"api_keys", "files", "batches", "alembic_version"}


def test_the_webhook_endpoints_migration_keeps_the_outbox(tmp_path):
    """0004 copies webhook_deliveries on SQLite (batch mode): deliveries planned before it stay, as global ones."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0003")
    old = Database(url)
    with old.engine.begin() as connection:
        connection.execute(text("INSERT INTO webhook_events (id, type, batch_id, owner, created_at) "
                                "VALUES ('evt_1', 'batch.completed', 'batch_1', 'a', 5)"))
        connection.execute(text("INSERT INTO webhook_deliveries (event_id, url, attempts, next_attempt_at) "
                                "VALUES ('evt_1', 'http://127.0.0.1:9/hook', 2, 60)"))
    old.upgrade()
    with old.session() as session:
        (delivery, event, secret), = webhooks.due(session, at=60)
        assert (delivery.url, delivery.attempts, delivery.endpoint_id, event.id, secret) == (
            "http://127.0.0.1:9/hook", 2, None, "evt_1", None)
    with old.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    command.downgrade(alembic_config(url), "0003")  # and back
    with old.engine.connect() as connection:
        assert "webhook_endpoints" not in inspect(connection).get_table_names()
        assert connection.execute(text("SELECT count(*) FROM webhook_deliveries")).scalar() == 1
    old.dispose()


def test_the_parent_batch_migration_keeps_only_same_owner_parents(tmp_path):
    """0005: a retry's parent moves from its metadata to its own column, only where the parent is the owner's own."""
    check_the_parent_batch_migration(f"sqlite:///{tmp_path / 'old.db'}")


def check_the_parent_batch_migration(url: str) -> None:
    """The 0005 migration on the store at `url` (tests/system/test_tenancy_postgres.py runs it on PostgreSQL)."""
    meta_value = ":meta" if url.startswith("sqlite") else "CAST(:meta AS json)"
    command.upgrade(alembic_config(url), "0004")
    old = Database(url)
    rows = {"a1": ("a", None), "a2": ("a", "a1"), "a3": ("a", "b1"), "a4": ("a", "nowhere"), "b1": ("b", None)}
    with old.engine.begin() as connection:
        connection.execute(text("INSERT INTO api_keys (owner, created_at) VALUES ('a', 1), ('b', 1)"))
        for batch_id, (owner, parent) in rows.items():
            meta = json.dumps({"job": "x"} | ({"parent_batch_id": parent} if parent else {}))
            connection.execute(text(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, "
                "request_total, request_completed, request_failed, metadata) VALUES "
                f"(:id, :owner, '/v1/chat/completions', 'file-x', '24h', 'completed', 1, 0, 0, 0, {meta_value})"),
                {"id": batch_id, "owner": owner, "meta": meta})
    old.upgrade()
    with old.session() as session:
        parents = dict(session.execute(select(BatchRecord.id, BatchRecord.parent_batch_id)).all())
        assert parents == {"a1": None, "a2": "a1", "a3": None, "a4": None, "b1": None}
        # The metadata is left as it was: shown, never followed.
        assert session.scalar(select(BatchRecord.meta).where(BatchRecord.id == "a3")) == {
            "job": "x", "parent_batch_id": "b1"}
    with old.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    command.downgrade(alembic_config(url), "0004")
    with old.engine.connect() as connection:
        assert "parent_batch_id" not in {c["name"] for c in inspect(connection).get_columns("batches")}
        assert connection.execute(text("SELECT count(*) FROM batches")).scalar() == 5
    old.dispose()


def test_the_options_migration_keeps_priority_and_max_cost(tmp_path):
    """0009: a batch's priority and max_cost move into its options column, only those that differ from the defaults."""
    check_the_options_migration(f"sqlite:///{tmp_path / 'old.db'}")


def check_the_options_migration(url: str) -> None:
    """The 0009 migration on the store at `url` (tests/system/test_tenancy_postgres.py runs it on PostgreSQL)."""
    command.upgrade(alembic_config(url), "0008")
    old = Database(url)
    rows = {"plain": (0, None), "urgent": (5, None), "capped": (0, 1.5), "both": (-2, 0.25)}
    with old.engine.begin() as connection:
        connection.execute(text("INSERT INTO api_keys (owner, created_at) VALUES ('a', 1)"))
        for batch_id, (priority, max_cost) in rows.items():
            connection.execute(text(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, "
                "request_total, request_completed, request_failed, priority, max_cost) VALUES (:id, 'a', "
                "'/v1/chat/completions', 'file-x', '24h', 'completed', 1, 0, 0, 0, :priority, :max_cost)"),
                {"id": batch_id, "priority": priority, "max_cost": max_cost})
    old.upgrade()
    with old.session() as session:
        batches = {b.id: b for b in session.scalars(select(BatchRecord))}
        assert {b: (batches[b].options.priority, batches[b].options.max_cost) for b in rows} == rows
        assert batches["plain"].stored_options is None and batches["urgent"].stored_options == {"priority": 5}
    with old.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    command.downgrade(alembic_config(url), "0008")  # and back
    with old.engine.connect() as connection:
        back = connection.execute(text("SELECT id, priority, max_cost FROM batches")).all()
        assert {batch_id: (priority, max_cost) for batch_id, priority, max_cost in back} == rows
    old.dispose()


def test_migrations_render_for_postgres():
    out = io.StringIO()
    with redirect_stdout(out):
        command.upgrade(alembic_config("postgresql://user@localhost/batches"), "head", sql=True)
    sql = out.getvalue()
    assert "CREATE TABLE batches" in sql and "BIGSERIAL" in sql and "JSON" in sql


def add_batch(session, owner: str, status: str = "validating", created_at: int = 1000) -> BatchRecord:
    row = BatchRecord(id=repo.new_batch_id(), owner=owner, endpoint="/v1/chat/completions", input_file_id="file-x",
                      completion_window="24h", status=status, created_at=created_at)
    session.add(row)
    session.commit()
    return row


def test_pages_are_newest_first_and_scoped_by_owner(store):
    with store.session() as s:
        repo.ensure_owners(s, ["a", "b"])
        ids = [add_batch(s, "a").id for _ in range(5)]  # all in the same second: order by insertion
        add_batch(s, "b")
        rows, more = repo.list_batches(s, "a", after=None, limit=3)
        assert [r.id for r in rows] == ids[::-1][:3] and more
        rows, more = repo.list_batches(s, "a", after=rows[-1].id, limit=3)
        assert [r.id for r in rows] == ids[::-1][3:] and not more
        assert repo.list_batches(s, "b", after=ids[0], limit=3) is None  # another owner's cursor
        assert repo.get_batch(s, "b", ids[0]) is None


def test_launch_queue(store):
    with store.session() as s:
        repo.ensure_owners(s, ["a"])
        waiting, cancelling, done = add_batch(s, "a"), add_batch(s, "a", "cancelling"), add_batch(s, "a", "failed")
        assert [b.id for b in repo.batches_to_launch(s)] == [waiting.id, cancelling.id]
        repo.mark_launched(s, [waiting.id, cancelling.id])
        assert repo.batches_to_launch(s) == []
        assert {b.id for b in repo.active_batches(s)} == {waiting.id, cancelling.id}
        assert done.id not in {b.id for b in repo.active_batches(s)}


def test_a_batch_records_its_model_and_a_local_input_is_copied_once(store, tmp_path):
    from batch_dagster.batchfile.options import BatchRequest
    from batch_dagster.db.batches import create_batch, register_local

    storage = LocalStorage(tmp_path / "data")
    source = tmp_path / "in.jsonl"
    first = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m1", "input": "x"}}
    source.write_text(json.dumps(first) + "\n" + json.dumps({**first, "custom_id": "b"}))  # no final newline
    with store.session() as s:
        local = register_local(s, storage, source, owner="a")
        file = s.scalar(select(FileRecord).where(FileRecord.id == local.input_file_id))
        assert (local.model, local.request_total, local.endpoint) == ("m1", 2, "/v1/embeddings")
        folder = BatchFolder(storage, local.id)
        assert file.path == folder.input_key and storage.list("files") == []  # the folder's copy is the File
        # An uploaded File: its model from its head, read once at creation; its count comes with validation.
        uploaded = create_batch(s, storage, BatchRequest(owner="a", input_file_id=file.id, endpoint="/v1/embeddings"),
                                file)
        s.commit()
        assert (uploaded.model, uploaded.request_total) == ("m1", 0)
        # Deleting the local batch's File forgets it but keeps the folder's input, which a re-run reads.
        repo.delete_file(s, storage, file)
        assert s.scalar(select(FileRecord).where(FileRecord.id == local.input_file_id)) is None
        assert storage.exists(folder.input_key) and storage.exists(BatchFolder(storage, uploaded.id).input_key)


def row(**kw) -> BatchRecord:
    base = dict(id="batch_1", owner="a", endpoint="/v1/chat/completions", input_file_id="f", completion_window="24h",
                status="validating", created_at=1, request_total=0, request_completed=0, request_failed=0)
    return BatchRecord(**{**base, **kw})


def test_changes_only_move_forward():
    running = Observation("in_progress", {"in_progress_at": 10}, RequestCounts(total=4, completed=2, failed=0))
    assert changes(row(), running) == {"status": "in_progress", "in_progress_at": 10, "request_total": 4,
                                       "request_completed": 2}
    assert changes(row(status="in_progress", in_progress_at=5), running) == {"request_total": 4, "request_completed": 2}
    # A cancel request holds the status at cancelling until the run ends; finalizing is not reported.
    merging = Observation("finalizing", {"in_progress_at": 10, "finalizing_at": 20})
    assert changes(row(status="cancelling", cancelling_at=15, in_progress_at=10), merging) == {}
    assert changes(row(status="cancelling", cancelling_at=15), Observation("cancelled", {"cancelled_at": 30})) == {
        "status": "cancelled", "cancelled_at": 30}
    for status in TERMINAL:
        assert changes(row(status=status), Observation("completed", {"completed_at": 1})) == {}
    failed = run_failed(running, "boom", at=40)
    assert failed.status == "failed" and failed.errors[0].code == "pipeline_error"
    assert run_failed(Observation("completed"), "boom").status == "completed"


def test_observe_follows_the_pipeline_files(tmp_path):
    from batch_dagster.batchfile.results import commit_shard

    folder = BatchFolder(LocalStorage(tmp_path), "batch_x")
    assert observe(folder).status == "validating"
    folder.write_validation(Validation(True, 3, "m", "/v1/chat/completions", 0, []))
    obs = observe(folder)
    assert (obs.status, obs.request_counts, obs.model) == ("in_progress", RequestCounts(3, 0, 0), "m")
    folder.write_manifest(Manifest("batch_x", "/v1/chat/completions", "m", 3, 3, 1, [3]))
    assert observe(folder).status == "in_progress"
    commit_shard(folder.storage, folder.results_prefix, 0, [])
    assert observe(folder).status == "finalizing"
    invalid = BatchFolder(LocalStorage(tmp_path), "batch_y")
    invalid.write_validation(Validation(False, 2, None, None, 1, [BatchError("invalid_json", "x", line=2)]))
    assert observe(invalid).errors == [BatchError("invalid_json", "x", line=2)]


def test_the_end_is_registered_once_when_two_observers_race(store, tmp_path):
    with store.session() as s:
        repo.ensure_owners(s, ["a"])
        batch_id = add_batch(s, "a").id
    folder = BatchFolder(LocalStorage(tmp_path), batch_id)
    for key in (folder.output_key, folder.error_key):
        folder.storage.write_bytes(key, b"")
    end = Observation("completed", {"completed_at": 50}, RequestCounts(total=0, completed=0, failed=0), has_files=True)
    with store.session() as first, store.session() as second:
        # Both loaded the batch while it was still running; both see it end.
        mine, theirs = repo.get_batch(first, "a", batch_id), repo.get_batch(second, "a", batch_id)
        apply(first, folder, mine, end)
        apply(second, folder, theirs, end)
        assert theirs.status == "completed" and theirs.output_file_id == mine.output_file_id
        files = second.scalars(select(FileRecord).where(FileRecord.batch_id == batch_id)).all()
        assert sorted(f.filename for f in files) == [f"{batch_id}_error.jsonl", f"{batch_id}_output.jsonl"]


def test_batch_list_filters_on_sqlite(store):
    check_batch_filters(store)
