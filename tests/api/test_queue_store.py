"""Queue position and ETA (features/eta.py): the running batches from their progress, the waiting ones in the run
queue's order; in the store, the model's rate from its recent batches, every unfinished batch placed in one pass
and stored, only what moved written again."""

from __future__ import annotations

import pytest

from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.db.models import WebhookEvent
from batch_dagster.features.eta import (
    Entry,
    RunningEta,
    launch_order,
    meets_deadline,
    plan,
    refresh_queue,
    running_remaining_s,
    set_launch_priorities,
)
from batch_dagster.features.fairness import launch_priority
from batch_dagster.features.throughput import Throughput, bounded_work, busy_s, queue_throughput

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

    moved = refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW).moved
    assert {m.batch_id for m in moved} == {"running", "later", "sooner", "elsewhere"}
    stored = {b.id: (b.queue_position, b.estimated_completion_at) for b in session.query(BatchRecord)}
    # Half done in 50 s, and 500 tokens left at 10/s: 50 s more; then 2,000 tokens each, one slot.
    assert stored["running"] == (0, NOW + 50)
    assert stored["sooner"] == (1, NOW + 50 + 200) and stored["later"] == (2, NOW + 50 + 400)
    assert stored["elsewhere"] == (1, NOW + 1000 * 0.5 / 250)  # its own model: the defaults
    assert stored["done0"] == (None, None)
    assert next(m for m in moved if m.batch_id == "sooner").new_position
    assert refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW).moved == []  # nothing moved


def test_a_batch_estimated_to_end_after_its_deadline_says_so_once_with_its_event(session):
    for i in range(2):  # 10 tokens/s, as above
        add(session, f"done{i}", "completed", estimate=ESTIMATE, in_progress_at=NOW - 200 * (i + 1),
            completed_at=NOW - 200 * (i + 1) + 100)
    # 2,000 tokens each, one slot: "first" ends at NOW + 200, "second" at NOW + 400.
    add(session, "first", "validating", file="f2000", expires_at=NOW + 3600, launch_priority=0)
    add(session, "second", "validating", file="f2000", expires_at=NOW + 300, launch_priority=-1)
    add(session, "no_deadline", "validating", launch_priority=-2)

    refreshed = refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW)
    assert [m.batch_id for m in refreshed.at_risk] == ["second"]
    rows = {b.id: b for b in session.query(BatchRecord)}
    assert rows["second"].deadline_at_risk_at == NOW and rows["first"].deadline_at_risk_at is None
    assert meets_deadline(rows["second"].estimated_completion_at, rows["second"].expires_at) is False
    assert meets_deadline(rows["first"].estimated_completion_at, rows["first"].expires_at) is True
    assert meets_deadline(rows["no_deadline"].estimated_completion_at, None) is None
    [event] = session.query(WebhookEvent).all()
    assert (event.type, event.batch_id, event.created_at) == ("batch.deadline_at_risk", "second", NOW)
    # Still at risk a tick later: flagged once, one event.
    assert refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW + 5).at_risk == []
    assert session.query(WebhookEvent).count() == 1





def test_a_batch_whose_upload_was_deleted_keeps_its_place(session):
    """Its File is gone (the key deleted the upload after create): it is still queued, sized by its folder's copy
    of its input, and every batch behind it waits for it."""
    add(session, "first", "validating", file="gone", stored_bytes=2000)
    add(session, "second", "validating", file="f2000")
    set_launch_priorities(session, {"first": 0, "second": -1})
    refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW)
    stored = {b.id: (b.queue_position, b.estimated_completion_at) for b in session.query(BatchRecord)}
    assert stored["first"][0] == 1 and stored["second"][0] == 2
    assert stored["second"][1] > stored["first"][1] > NOW


def waiting(batch_id: str, work: float | None, *, priority: int = 0, rank: int | None = 0, pk: int = 1,
            input_bytes: int = 0) -> Entry:
    launched = None if rank is None else launch_priority(rank, priority)
    return Entry(batch_id, running=False, order=launch_order(priority, launched, pk), work=work,
                 input_bytes=input_bytes)


def test_a_running_batch_blends_the_time_it_ran_with_the_fraction_done():
    # Half done in 20 s at 10 tokens/s: by time 800 tokens left, by count 500, each counting a half.
    assert running_remaining_s(1000, 10, 0.5, 20) == pytest.approx(65)
    # Nothing visible done yet: its tokens less what 20 s should have done; overdue, a twentieth of them.
    assert running_remaining_s(1000, 10, 0.0, 20) == pytest.approx(80)
    assert running_remaining_s(1000, 10, 0.0, 500) == pytest.approx(5)
    assert running_remaining_s(1000, 10, 0.9, 90) == pytest.approx(0.1 * 10 + 0.9 * 10)
    assert running_remaining_s(1000, 10, 1.0, 90) == 0


def test_waiting_batches_follow_the_launch_order_one_slot_after_another():
    running = Entry("run", running=True, order=(), work=1000, done=0.5, in_progress_at=int(NOW - 50))
    places = plan([waiting("old", 200, pk=1), waiting("urgent", 300, priority=5, pk=3), running,
                   waiting("new", 100, pk=2, rank=-1)], Throughput(10.0), slots=1, now=NOW)
    # The running one: half its 1000 tokens in 50 s, so 50 s more by its pace and by its tokens alike.
    assert places["run"].queue_position == 0 and places["run"].estimated_completion_at == NOW + 50
    # Higher priority first; then the run queue's fair rank (dagster/priority), then submission order.
    assert [(b, places[b].queue_position) for b in ("urgent", "old", "new")] == [("urgent", 1), ("old", 2), ("new", 3)]
    assert places["urgent"].estimated_completion_at == NOW + 50 + 30
    assert places["old"].estimated_completion_at == NOW + 50 + 30 + 20
    assert places["new"].estimated_completion_at == NOW + 50 + 30 + 20 + 10


def test_free_slots_start_the_first_waiting_batches_now_sharing_the_engine():
    places = plan([waiting("a", 100, pk=1), waiting("b", 100, pk=2), waiting("c", 100, pk=3)], Throughput(10.0), slots=2,
                  now=NOW)
    # a and b at 5 tokens/s each end together; then c has the engine to itself.
    assert [places[b].estimated_completion_at - NOW for b in "abc"] == [20, 20, 30]
    assert [places[b].queue_position for b in "abc"] == [1, 2, 3]


def test_more_runs_than_slots_free_one_when_enough_have_ended():
    runs = [Entry(f"r{i}", running=True, order=(), work=10.0 * i, in_progress_at=int(NOW)) for i in (1, 2, 3)]
    places = plan([*runs, waiting("w", 10)], Throughput(1.0), slots=2, now=NOW)
    # Three share the engine until the first ends (30 s), two until the second (50 s); then w starts beside the
    # third's last 10 tokens, and both end together.
    assert [places[b].estimated_completion_at - NOW for b in ("r1", "r2", "r3", "w")] == [30, 50, 70, 70]


def test_a_batch_not_validated_yet_counts_its_bytes_at_the_measured_tokens_per_byte():
    places = plan([waiting("a", None, input_bytes=1000)], Throughput(10.0, tokens_per_byte=0.2), slots=1, now=NOW)
    assert places["a"].estimated_completion_at == NOW + 20


def test_a_batch_not_launched_yet_goes_after_the_launched_of_its_priority_and_before_lower_ones():
    orders = {"launched_late": launch_order(0, launch_priority(-9, 0), 9), "unlaunched": launch_order(0, None, 1),
              "low": launch_order(-1, launch_priority(0, -1), 0)}
    assert sorted(orders, key=orders.__getitem__) == ["launched_late", "unlaunched", "low"]


def test_the_work_is_the_estimates_bounded_tokens():
    assert bounded_work({"input_tokens": 10, "max_output_tokens": 40}) == 50
    assert bounded_work({"input_tokens": None, "max_output_tokens": None}) is None  # an invalid file's estimate
    assert bounded_work(None) is None


def test_the_progress_bar_shows_the_end_on_the_clock(monkeypatch):
    import time

    from batch_dagster.defs.runner import clock

    monkeypatch.setattr(time, "time", lambda: NOW)
    eta = RunningEta.of({"input_tokens": 100, "max_output_tokens": 900, "tokens_per_s": 10.0}, total=2)
    assert clock(eta, 0) == time.strftime("%H:%M:%S", time.localtime(NOW + 100))
    # Half done after 10 s: by time 900 tokens left, by count 500, half each, at 10 tokens/s.
    eta.started = NOW - 10
    assert clock(eta, 1) == time.strftime("%H:%M:%S", time.localtime(NOW + (0.5 * 900 + 0.5 * 500) / 10))
    assert clock(RunningEta.of(None, total=2), 0) == "?"  # no estimate and nothing done: nothing to say yet


def test_the_rate_counts_the_time_one_batch_at_least_ran():
    assert busy_s([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert busy_s([]) == 0
