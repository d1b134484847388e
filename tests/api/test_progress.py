"""Live progress: request_counts and the run's log move while a shard is being inferred, not only at commits."""

from __future__ import annotations

import re

import dagster as dg

from tests.helpers import FakeEngine, rows, upload, wait_for


def test_request_counts_and_log_move_within_a_shard(start_service, tmp_path):
    seen: list[tuple[str, int, int]] = []
    engine = FakeEngine()
    service = start_service(shard_size=1000, engine=engine)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(1000, max_tokens=4))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

    def look(done: int) -> None:  # the engine pauses here, mid-shard, while the API is asked
        if done in (500, 900):
            service.worker.follow()  # what the daemon's status sensor does every few seconds while the run goes on
            b = client.batches.retrieve(batch.id)
            seen.append((b.status, b.request_counts.completed, b.request_counts.total))

    engine.on_request = look
    done = wait_for(client, batch.id, "completed")
    assert done.request_counts.completed == 1000 and len(engine.calls) == 1  # one shard
    assert [s for s, _, _ in seen] == ["in_progress", "in_progress"]
    (_, half, total), (_, most, _) = seen
    assert total == 1000 and 0 < half <= 500 and half < most <= 900  # approximate, never ahead of the engine

    [run] = service.instance.get_runs(dg.RunsFilter(tags={"dagster/partition": batch.id}))
    messages = [e.user_message for e in service.instance.all_logs(run.run_id) if e.user_message]
    progress = [m for m in messages if re.match(r"Shard 0: \d+/1000 requests \(\d+%\)", m)]
    assert len(progress) >= 9, messages  # every 10% at least, before the shard's commit line
    assert any("engine: " in m and "unfinished" in m for m in progress)
    commit = next(i for i, m in enumerate(messages) if m.startswith("Shard 0: 1000 completed"))
    assert messages.index(progress[0]) < commit
