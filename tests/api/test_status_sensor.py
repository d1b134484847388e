"""The status sensor's cost per tick: it follows only the batches whose runs changed since its cursor, reads one
progress document per batch whose run goes on (whatever its shard count), and walks every batch only in a sweep."""

from __future__ import annotations

import json
from collections import Counter

import dagster as dg
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import Manifest, Validation
from batch_dagster.batchfile.results import commit_shard, committed_shards, progress_of
from batch_dagster.db import BatchRecord, repo
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource
from batch_dagster.defs.sensors import api_batches
from batch_dagster.defs.sensors.api_batches import StatusCursor, api_batch_status_sensor
from batch_dagster.storage.local import LocalStorage

CHAT = "/v1/chat/completions"
STORAGE_CALLS = ("read_bytes", "list", "list_folders", "modified_at", "exists", "size", "open", "local_copy")
RUN_QUERIES = ("get_runs", "get_run_records", "get_runs_count", "get_run_record_by_id", "get_records_for_run")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The sensor's resources on an empty store, a test instance, and a count of the storage calls and run queries
    (by key: the batch folder each call reads)."""
    storage = StorageResource(data_dir=str(tmp_path))
    resources = {"database": DatabaseResource(url=f"sqlite:///{tmp_path / 'api.db'}"), "storage": storage,
                 "pipeline": PipelineConfig()}
    calls: Counter[str] = Counter()

    def counted(name, method, of_key):
        def call(*args, **kwargs):
            calls[f"{name}:{of_key(args)}"] += 1
            return method(*args, **kwargs)
        return call

    for name in STORAGE_CALLS:
        # The batch folder a call reads: batches/<id>/...
        monkeypatch.setattr(LocalStorage, name, counted(name, getattr(LocalStorage, name),
                                                        lambda args: "/".join(args[1].split("/")[:2])))
    with dg.instance_for_test() as instance:
        for name in RUN_QUERIES:
            monkeypatch.setattr(instance, name, counted(name, getattr(instance, name), lambda args: "runs"))
        yield instance, resources, storage, calls


def _in_progress(resources, storage, batch_id: str, shards: int = 1) -> None:
    """A launched batch whose run has committed `shards` shards of 2 requests (its markers and progress document),
    and runs on."""
    with resources["database"].session() as session:
        repo.ensure_owners(session, ["a"])
        session.add(BatchRecord(id=batch_id, owner="a", endpoint=CHAT, input_file_id="file-x", completion_window="24h",
                                status="in_progress", created_at=repo.now(), launched_at=repo.now(),
                                in_progress_at=repo.now(), request_total=4 * shards))
        session.commit()
    folder = storage.folder(batch_id)
    total = 4 * shards  # as many shards again to run
    folder.write_validation(Validation(True, total, "m", CHAT, 0, []))
    folder.write_manifest(Manifest(batch_id, CHAT, "m", total, 2, 2 * shards, [2] * (2 * shards)))
    for index in range(shards):
        commit_shard(folder.storage, folder.results_prefix, index,
                     [c.request_error_line(f"{index}-{i}", "server_error", "x", status_code=500) for i in range(2)])
    folder.write_progress(progress_of(committed_shards(folder.storage, folder.results_prefix), total, 2 * shards))


def _run(instance, batch_id: str, status=dg.DagsterRunStatus.STARTED) -> dg.DagsterRun:
    run = dg.DagsterRun(job_name="batch_job", status=status, tags={"dagster/partition": batch_id})
    instance.add_run(run)
    return run


def tick(instance, resources, cursor: str | None = None) -> tuple[str, str | None]:
    """One evaluation with the cursor the last one left (as the daemon keeps it): its message, and its cursor."""
    context = dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor)
    return api_batch_status_sensor(context).skip_message, context.cursor


def _reads(calls: Counter[str], batch_id: str) -> int:
    return sum(n for key, n in calls.items() if key.endswith(f":batches/{batch_id}"))


def test_a_tick_follows_only_the_batch_whose_run_changed(env, monkeypatch):
    instance, resources, storage, calls = env
    monkeypatch.setattr(api_batches, "RUN_CURSOR_OVERLAP_S", 0.0)  # the runs below were created within a second
    ids = [f"batch_{i:02d}" for i in range(12)]
    runs = {}
    for batch_id in ids:
        _in_progress(resources, storage, batch_id)
        runs[batch_id] = _run(instance, batch_id, dg.DagsterRunStatus.NOT_STARTED)  # waiting in the run queue
    # No cursor yet: a sweep follows every batch once (a run still waiting has written nothing: no storage read).
    message, cursor = tick(instance, resources)
    assert message == "0 batch(es) changed status."
    with resources["database"].session() as session:
        assert {b.id: b.run_id for b in repo.active_batches(session)} == {i: runs[i].run_id for i in ids}

    calls.clear()
    message, cursor = tick(instance, resources, cursor)
    assert message == "0 batch(es) changed status."
    # Nothing moved: no batch folder read, and a fixed number of run queries (the changes, the runs going on).
    assert not [k for k in calls if k.startswith(tuple(STORAGE_CALLS))], calls
    assert sum(n for k, n in calls.items() if k.endswith(":runs")) == 2

    # One run ends badly: only its batch is read; the run that changed is the one it records, so no query for its
    # latest run is needed besides the tick's two (and its failure's events).
    instance.report_run_failed(runs["batch_07"], "the run worker died")
    calls.clear()
    message, cursor = tick(instance, resources, cursor)
    assert message == "1 batch(es) changed status."
    assert {k.split(":", 1)[1] for k in calls if k.startswith(tuple(STORAGE_CALLS))} == {"batches/batch_07"}
    assert (calls["get_run_records:runs"], calls["get_runs:runs"]) == (1, 1)
    with resources["database"].session() as session:
        failed = repo.get_batch(session, "a", "batch_07")
        assert failed.status == "failed" and "the run worker died" in failed.errors[0]["message"]
        assert {b.status for b in repo.active_batches(session)} == {"in_progress"}


def test_storage_reads_per_tick_do_not_grow_with_the_shard_count(env, monkeypatch):
    instance, resources, storage, calls = env
    monkeypatch.setattr(api_batches, "RUN_CURSOR_OVERLAP_S", 0.0)  # the runs below were created within a second
    _in_progress(resources, storage, "batch_small", shards=1)
    _in_progress(resources, storage, "batch_large", shards=50)
    for batch_id in ("batch_small", "batch_large"):
        _run(instance, batch_id)
    # The first tick sweeps (every batch followed whole), the next reads each progress document alone.
    calls.clear()
    message, cursor = tick(instance, resources)
    assert message == "0 batch(es) changed status."
    assert _reads(calls, "batch_small") == _reads(calls, "batch_large") <= 6, calls
    with resources["database"].session() as session:
        counts = {b.id: (b.request_total, b.request_failed) for b in repo.active_batches(session)}
    assert counts == {"batch_small": (4, 2), "batch_large": (200, 100)}  # the committed shards' failed lines

    calls.clear()
    tick(instance, resources, cursor)
    assert _reads(calls, "batch_small") == _reads(calls, "batch_large") == 1, calls  # progress.json
    assert calls["read_bytes:batches/batch_large"] == 1

    # A shard commits: the next tick's one read moves the counts on.
    folder = storage.folder("batch_large")
    commit_shard(folder.storage, folder.results_prefix, 50, [c.request_error_line("x", "server_error", "x",
                                                                                  status_code=500)])
    folder.write_progress(progress_of(committed_shards(folder.storage, folder.results_prefix), 200, 100))
    calls.clear()
    tick(instance, resources, cursor)
    assert _reads(calls, "batch_large") == 1
    with resources["database"].session() as session:
        assert repo.get_batch(session, "a", "batch_large").request_failed == 101


def test_a_launch_with_no_run_is_requested_again_by_the_sweep(env, monkeypatch):
    instance, resources, storage, _ = env
    monkeypatch.setattr(api_batches, "RELAUNCH_AFTER_S", 0)
    _, cursor = tick(instance, resources)  # the first tick's sweep: nothing there yet
    with resources["database"].session() as session:
        repo.ensure_owners(session, ["a"])
        session.add(BatchRecord(id="batch_lost", owner="a", endpoint=CHAT, input_file_id="file-x",
                                completion_window="24h", status="validating", created_at=repo.now(),
                                launched_at=repo.now() - 1))
        session.commit()

    def launched() -> bool:
        with resources["database"].session() as session:
            return repo.get_batch(session, "a", "batch_lost").launched_at is not None

    # No run changed: the ticks between two sweeps do not look at it.
    _, cursor = tick(instance, resources, cursor)
    assert launched()
    # The sweep's period passed: its pass finds the launch that has no run, and asks for it again.
    state = json.loads(cursor)
    _, cursor = tick(instance, resources, StatusCursor(**{**state, "swept_at": state["swept_at"] - 61}).dumps())
    assert not launched()


def test_a_run_waiting_on_its_retry_decision_is_followed_again_whatever_its_runs_do(env, monkeypatch):
    instance, resources, storage, _ = env
    _in_progress(resources, storage, "batch_retry")
    run = _run(instance, "batch_retry")
    _, cursor = tick(instance, resources)
    instance.report_run_failed(run, "the run worker died")
    # Run retries on (dagster.yaml), and the daemon has not decided yet (no will_retry tag).
    monkeypatch.setattr(type(instance), "run_retries_enabled", property(lambda self: True))
    _, cursor = tick(instance, resources, cursor)
    # Dagster has not tagged it yet: the batch waits, and the cursor names it to follow again.
    assert json.loads(cursor)["watch"] == ["batch_retry"]
    with resources["database"].session() as session:
        assert repo.get_batch(session, "a", "batch_retry").status == "in_progress"
    monkeypatch.setattr(api_batches, "RETRY_DECISION_WAIT_S", -1)  # no decision came in time: the batch fails
    state = json.loads(cursor)
    later = StatusCursor(**{**state, "runs_after": state["runs_after"] + 60}).dumps()  # no run change since
    message, cursor = tick(instance, resources, later)
    assert message == "1 batch(es) changed status." and json.loads(cursor)["watch"] == []


def test_a_retry_run_is_followed_in_place_of_the_run_the_batch_recorded(env):
    instance, resources, storage, calls = env
    _in_progress(resources, storage, "batch_retried")
    first = _run(instance, "batch_retried")
    _, cursor = tick(instance, resources)
    # The first run's worker died; Dagster retries it as a new run of the partition.
    instance.report_run_failed(first, "the run worker died")
    instance.add_run_tags(first.run_id, {"dagster/will_retry": "true"})
    retry = _run(instance, "batch_retried")
    calls.clear()
    _, cursor = tick(instance, resources, cursor)
    assert calls["get_runs:runs"] == 2  # the runs going on, and the batch's latest (not the one it recorded)
    with resources["database"].session() as session:
        batch = repo.get_batch(session, "a", "batch_retried")
        assert (batch.status, batch.run_id) == ("in_progress", retry.run_id)


def test_a_burst_of_runs_ending_at_once_spreads_over_ticks_and_every_batch_ends(env, monkeypatch):
    """Past the tick's budget the batches to follow whole wait for the next tick, each tick moving at least its
    minimum: a burst of thousands costs several short ticks, never one of minutes, and none is lost."""
    instance, resources, storage, _ = env
    monkeypatch.setattr(api_batches, "RUN_CURSOR_OVERLAP_S", 0.0)
    monkeypatch.setattr(api_batches, "FOLLOW_BUDGET_S", 0.0)  # every tick is over it at once
    monkeypatch.setattr(api_batches, "MIN_FOLLOWED_PER_TICK", 2)
    ids = [f"batch_{i:02d}" for i in range(5)]
    runs = {}
    for batch_id in ids:
        _in_progress(resources, storage, batch_id)
        runs[batch_id] = _run(instance, batch_id)
    _, cursor = tick(instance, resources)  # the first: a sweep, two by two
    for _ in range(3):
        _, cursor = tick(instance, resources, cursor)
    for run in runs.values():  # all five runs fail at once
        instance.report_run_failed(run, "the run worker died")
    moved = []
    for _ in range(5):
        message, cursor = tick(instance, resources, cursor)
        moved.append(int(message.split()[0]))
    assert moved[:3] == [2, 2, 1] and sum(moved) == 5, moved
    with resources["database"].session() as session:
        assert not repo.active_batches(session)



def test_a_storage_outage_while_keeping_a_failed_runs_work_is_tried_again(env, monkeypatch):
    """The store fails (an S3 503) while the sensor keeps what a failed run finished: the batch stays in progress
    and is followed again (it never ends without its files over a passing outage), and is kept once the store
    answers (tests/core/test_failure.py checks what keeping writes)."""
    instance, resources, storage, _ = env
    _in_progress(resources, storage, "batch_kept")
    run = _run(instance, "batch_kept")
    _, cursor = tick(instance, resources)
    instance.report_run_failed(run, "the run worker died")
    kept, keep = [], api_batches.keep_finished

    def outage(folder, reason, prices):
        kept.append(folder.batch_id)
        if len(kept) == 1:
            raise OSError("503 Service Unavailable")
        return keep(folder, reason, prices)

    monkeypatch.setattr(api_batches, "keep_finished", outage)
    _, cursor = tick(instance, resources, cursor)
    assert json.loads(cursor)["watch"] == ["batch_kept"]
    with resources["database"].session() as session:
        assert repo.get_batch(session, "a", "batch_kept").status == "in_progress"
    message, cursor = tick(instance, resources, cursor)
    assert kept == ["batch_kept", "batch_kept"]
    assert message == "1 batch(es) changed status." and json.loads(cursor)["watch"] == []
    monkeypatch.setattr(api_batches, "KEEP_FINISHED_FOR_S", -1)  # an outage that outlasts it: the batch ends
    _in_progress(resources, storage, "batch_lost")
    lost = _run(instance, "batch_lost")
    _, cursor = tick(instance, resources, cursor)
    instance.report_run_failed(lost, "the run worker died")
    kept.clear()
    monkeypatch.setattr(api_batches, "keep_finished", lambda *a: (_ for _ in ()).throw(OSError("503")))
    message, cursor = tick(instance, resources, cursor)
    with resources["database"].session() as session:
        assert repo.get_batch(session, "a", "batch_lost").status == "failed"
