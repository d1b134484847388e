"""Queue position and ETA in the store (features/eta.py): the model's rate from its recent batches, every unfinished batch
placed in one pass and stored, only what moved written again."""

from __future__ import annotations

import pytest

from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.features.eta import refresh_queue, set_launch_priorities
from batch_dagster.features.throughput import queue_throughput

NOW = 1_000_000
ESTIMATE = {"input_tokens": 100, "max_output_tokens": 900}  # 1,000 bounded tokens


@pytest.fixture
def session(tmp_path):
    store = Database(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    with store.session() as s:
        repo.ensure_owners(s, ["a"])
        s.add_all([FileRecord(id=f"f{n}", owner="a", bytes=n, created_at=1, filename="in.jsonl", purpose="batch",
                              path=f"files/f{n}") for n in (1000, 2000)])
        s.commit()
        yield s
    store.dispose()


def add(s, batch_id: str, status: str, *, model: str = "m", file: str = "f1000", **kw) -> BatchRecord:
    row = BatchRecord(id=batch_id, owner="a", endpoint="/v1/chat/completions", input_file_id=file,
                      completion_window="24h", status=status, created_at=1, model=model, **kw)
    s.add(row)
    s.commit()
    return row


def test_the_rate_is_bounded_work_per_second_of_the_models_recent_batches(session):
    assert queue_throughput(session, "m", 250.0).tokens_per_s == 250.0 and queue_throughput(session, "m", 250.0).batches == 0
    # 1,000 tokens and 1,000 bytes of input each; one alone for 200 s, then two together for 100 s: 300 s in all.
    add(session, "done0", "completed", estimate=ESTIMATE, in_progress_at=NOW - 500, completed_at=NOW - 300)
    for i in (1, 2):
        add(session, f"done{i}", "completed", estimate=ESTIMATE, in_progress_at=NOW - 200, completed_at=NOW - 100)
    add(session, "failed", "failed", estimate=ESTIMATE, in_progress_at=NOW - 200, completed_at=NOW - 199)
    rate = queue_throughput(session, "m", 250.0)
    assert (rate.tokens_per_s, rate.tokens_per_byte, rate.batches) == (10.0, 1.0, 3)
    assert queue_throughput(session, "other", 250.0).batches == 0


def test_every_unfinished_batch_is_placed_and_only_what_moved_is_written(session):
    for i in range(2):  # 1,000 tokens in 100 s each, one after the other: 10 tokens/s
        add(session, f"done{i}", "completed", estimate=ESTIMATE, in_progress_at=NOW - 200 * (i + 1),
            completed_at=NOW - 200 * (i + 1) + 100)
    add(session, "running", "in_progress", estimate=ESTIMATE, in_progress_at=NOW - 50, request_total=10,
        request_completed=4, request_failed=1, run_id="run-1")
    add(session, "later", "validating", file="f2000", run_id="run-2")  # not validated: its 2,000 bytes of input
    add(session, "sooner", "validating", file="f2000")
    add(session, "elsewhere", "validating", model="m2")
    set_launch_priorities(session, {"later": -1, "sooner": 0})

    moved = refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW)
    assert {m.batch_id for m in moved} == {"running", "later", "sooner", "elsewhere"}
    stored = {b.id: (b.queue_position, b.estimated_completion_at) for b in session.query(BatchRecord)}
    # Half done in 50 s, and 500 tokens left at 10/s: 50 s more; then 2,000 tokens each, one slot.
    assert stored["running"] == (0, NOW + 50)
    assert stored["sooner"] == (1, NOW + 50 + 200) and stored["later"] == (2, NOW + 50 + 400)
    assert stored["elsewhere"] == (1, NOW + 1000 * 0.5 / 250)  # its own model: the defaults
    assert stored["done0"] == (None, None)
    assert next(m for m in moved if m.batch_id == "sooner").new_position
    assert refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW) == []  # nothing moved
