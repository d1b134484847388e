"""Fair sharing under the real daemon (issue #18): with one run slot (BATCH_OFFLINE_RUNS=1), a key's backlog of
batches delays another key's batch by one run at most: B's batch runs right after A's first, ends while A's others
are still queued, and A's keep their order; a batch of higher priority, then a batch with a shorter completion
window (earliest deadline first, issue #32), submitted behind A's backlog, start before it. The engine is
tests.daemon_defs' fake, its calls for A's first two batches held until the batches meant to overtake them are
queued: what is under test is the launch order."""

from __future__ import annotations

import time

import dagster as dg
import pytest
from openai import OpenAI

from batch_dagster.features.fairness import launch_priority
from tests.helpers import EMBED_MODEL, Serve, batch_runs, write_jsonl

pytestmark = pytest.mark.timeout(600)
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


def wait(client: OpenAI, batch_id: str, statuses: set[str], serve: Serve, timeout_s: float = 300):
    deadline = time.time() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.time() < deadline and serve.proc.poll() is None, f"{batch_id}: {batch.status}\n{serve.logs()}"
        time.sleep(0.5)
    return batch


def queued(serve: Serve, *batches, statuses: list[dg.DagsterRunStatus] | None = None) -> None:
    """Once each of `batches` has its run in Dagster (the API sensor submitted it), in one of `statuses` if given."""
    deadline = time.time() + 300
    with serve.instance() as instance:
        while not all(instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": b.id}, statuses=statuses))
                      for b in batches):
            assert time.time() < deadline and serve.proc.poll() is None, serve.logs()
            time.sleep(0.2)


def test_a_second_keys_batch_finishes_while_the_first_keys_backlog_waits(tmp_path):
    def rows(name: str) -> list[dict]:  # custom_ids start with the file's name: a hold file of that name holds it
        return [{"custom_id": f"{name}-e{i}", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": EMBED_MODEL, "input": f"sentence number {i}"}} for i in range(2)]

    # A's first two runs are held in their engine call (tests.daemon_defs' BATCH_TEST_HOLD) until the batches that
    # must queue behind them are in the queue: B's behind A's first, the urgent and the 1h one behind A's second.
    hold = tmp_path / "hold"
    hold.mkdir()
    for name in ("a0", "a1"):
        (hold / name).touch()
    serve = Serve(tmp_path, module="tests.daemon_defs", BATCH_TEST_CALLS=str(tmp_path / "calls.jsonl"),
                  BATCH_TEST_HOLD=str(hold), BATCH_OFFLINE_RUNS="1", BATCH_KEY_MAX_PRIORITY="5")
    serve.env["BATCH_API_KEYS"] = f"tenant-a:{KEY_A},{KEY_B}"
    with serve:
        a, b = (OpenAI(base_url=f"http://127.0.0.1:{serve.api_port}/v1", api_key=key, max_retries=0, timeout=30)
                for key in (KEY_A, KEY_B))

        def create(client: OpenAI, name: str, window: str = "24h", **extra):
            with open(write_jsonl(tmp_path / f"{name}.jsonl", rows(name)), "rb") as f:
                file_id = client.files.create(file=f, purpose="batch").id
            return client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                         completion_window=window, extra_body=extra or None)  # type: ignore[arg-type]

        backlog = [create(a, f"a{i}") for i in range(4)]
        queued(serve, backlog[0], statuses=[dg.DagsterRunStatus.STARTED])  # A's first holds the one slot
        batch_b = create(b, "b")
        queued(serve, batch_b)
        (hold / "a0").unlink()
        done = wait(b, batch_b.id, {"completed", "failed"}, serve)
        a_when_b_ended = [a.batches.retrieve(x.id).status for x in backlog]
        # An urgent batch (issue #21's priority), submitted behind A's two still queued: it starts before them.
        urgent = create(a, "urgent", priority=5)
        # A 1h batch (issue #32), after it: due 23 h before A's 24h backlog, it goes ahead of it.
        hour = create(a, "hour", window="1h")
        queued(serve, urgent, hour)
        (hold / "a1").unlink()
        ended_a = [wait(a, x.id, {"completed", "failed"}, serve) for x in backlog]
        assert [wait(a, x.id, {"completed", "failed"}, serve).status for x in (urgent, hour)] == ["completed"] * 2
        with serve.instance() as instance:
            [run_b] = batch_runs(instance, batch_b.id)
            [run_urgent] = batch_runs(instance, urgent.id)
            [run_hour] = batch_runs(instance, hour.id)
            runs_a = [batch_runs(instance, x.id)[-1] for x in backlog]
            records = {r.run_id: instance.get_run_record_by_id(r.run_id)
                       for r in [run_b, run_urgent, run_hour, *runs_a]}
    start = {run_id: record.start_time or 0 for run_id, record in records.items()}

    assert done.status == "completed" and [x.status for x in ended_a] == ["completed"] * 4, serve.logs()
    # When B's batch ended, A's last two had not started: B waited for one run (A's first), not for A's backlog.
    assert a_when_b_ended[0] == "completed" and a_when_b_ended[2:] == ["validating", "validating"], a_when_b_ended
    assert min(start[r.run_id] for r in runs_a[2:]) > (records[run_b.run_id].end_time or 0)
    order = sorted([run_b, *runs_a], key=lambda r: start[r.run_id])
    assert [r.run_id for r in order] == [runs_a[0].run_id, run_b.run_id, *(r.run_id for r in runs_a[1:])]
    assert start[run_b.run_id] < start[run_urgent.run_id] < start[run_hour.run_id] < min(
        start[r.run_id] for r in runs_a[2:])
    assert hour.expires_at - hour.created_at == 3600  # the 1h window, as offered by default
    # Its own priority outranks every deadline and fair rank.
    assert int(run_urgent.tags["dagster/priority"]) > int(run_hour.tags["dagster/priority"]) + 10**11
    # The owner as the run tags show it: the key's name, or a keyed hash; never the key's plain hash.
    assert runs_a[0].tags["owner"] == "tenant-a" and run_b.tags["owner"].startswith("key-")
    assert [int(r.tags["fair_rank"]) for r in runs_a] == [0, -1, -2, -3] and run_b.tags["fair_rank"] == "0"
    assert [int(r.tags["dagster/priority"]) for r in [*runs_a, run_b]] == [
        launch_priority(rank, 0, x.expires_at) for rank, x in zip([0, -1, -2, -3, 0], [*backlog, batch_b], strict=True)]
