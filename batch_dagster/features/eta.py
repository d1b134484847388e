"""Where a batch is in its model's queue and when it will end: each batch not ended placed among its model's batches
(`refresh_queue`, stored on the rows by the daemon's queue_eta_sensor), and a running batch's end as its own run
sees it (`RunningEta`: the inference step's observations, the CLI's progress bar).

A batch's work is its estimate's bounded tokens (input tokens and most output tokens, throughput.bounded_work);
before validation (a queued batch is validated when its run starts) its input file's bytes times the tokens per
byte of the model's recent batches. The rate is the model's queue throughput (throughput.queue_throughput); the
batches running at once share it. A batch whose estimated end is past its deadline (expires_at) is flagged at risk
the first time it is (deadline_at_risk_at), with a batch.deadline_at_risk webhook event: before it expires.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.db.fleets import start_delays
from batch_dagster.db.lifecycle import add_event
from batch_dagster.db.models import DEADLINE_AT_RISK, BatchRecord, FileRecord

from .throughput import Throughput, bounded_work, queue_throughput


@dataclass(frozen=True)
class Entry:
    """A batch of the model that has not ended, as the queue sees it."""

    batch_id: str
    running: bool  # in_progress, finalizing or cancelling: its run holds one of the model's slots
    order: tuple[Any, ...]  # launch order among the waiting ones: smaller first (launch_order)
    work: float | None  # bounded tokens (bounded_work of its estimate); None before validation
    input_bytes: int = 0
    done: float = 0.0  # the fraction of its requests finished
    in_progress_at: int | None = None


@dataclass(frozen=True)
class Place:
    queue_position: int  # 0: running; n: the n-th of the model's waiting batches to start
    estimated_completion_at: int  # unix seconds


# The statuses of batches not ended: listed, so the status index serves the query (NOT IN would scan).
NOT_ENDED = tuple(s for s in BatchStatus if s not in TERMINAL)


def launch_order(priority: int, launch_priority: int | None, pk: int,
                 expires_at: int | None = None) -> tuple[int, int, float, int]:
    """The run queue's order (features/fairness.py): the batch's priority first, then its run's dagster/priority
    (priority, deadline and fair rank; a batch not launched yet ranks after those launched, the earliest deadline
    first), then submission order."""
    if launch_priority is not None:
        return -priority, 0, -launch_priority, pk
    return -priority, 1, expires_at if expires_at is not None else float("inf"), pk


def running_remaining_s(work: float, rate: float, done: float, elapsed_s: float) -> float:
    """Seconds left of a running batch that has `rate` to itself: what its work less what the time elapsed should
    have done (at least a twentieth of it), blended with its work less the fraction done, which counts as much as that
    fraction. The count lags the engine: progress comes a shard or a few requests at a time, and the engine batches
    the requests of every batch running together, so they finish late and together; an extrapolation of the pace so
    far (elapsed over the fraction done) overshot the end by up to 0.9 of the batch's whole time in the bench
    (docs/performance.md, Queue ETA)."""
    done = min(max(done, 0.0), 1.0)
    if rate <= 0:
        return elapsed_s * (1 - done) / done if done > 0 else 0.0
    by_time = max(work - max(elapsed_s, 0.0) * rate, work / 20)
    by_count = work * (1 - done)
    return ((1 - done) * by_time + done * by_count) / rate


def share_ends(running: list[float], waiting: list[float], rate: float, slots: int, now: float) -> list[float]:
    """When each batch ends when the model's engine works through `rate` tokens a second, shared evenly by the
    batches running at once (vLLM batches their requests together): the running ones' remaining work, then the
    waiting ones' in order, each starting once fewer than `slots` run. The ends of `running`
    then of `waiting`, in their order."""
    left = [*running, *waiting]
    ends = [now] * len(left)
    active = list(range(len(running)))
    queue = list(range(len(running), len(left)))
    t = now
    while active or queue:
        while queue and len(active) < max(slots, 1):
            active.append(queue.pop(0))
        share = rate / len(active)
        first = min(active, key=lambda i: left[i])
        step = left[first] / share
        t += step
        for i in active:
            left[i] -= step * share
        active.remove(first)
        ends[first] = t
    return ends


def plan(entries: list[Entry], rate: Throughput, slots: int, now: float) -> dict[str, Place]:
    """Each batch's place and estimated end: the running ones from their progress (share_ends gives them their
    share of the engine); then the waiting ones in launch order, as the model's `slots` (BATCH_RUNS_PER_MODEL) come
    free."""
    speed = max(rate.tokens_per_s, 1e-9)

    def work(e: Entry) -> float:
        return e.work if e.work is not None else e.input_bytes * rate.tokens_per_byte

    running = [e for e in entries if e.running]
    share = speed / max(min(len(running), max(slots, 1)), 1)
    remaining = [share * running_remaining_s(
        work(e), share, e.done, now - e.in_progress_at if e.in_progress_at is not None else 0.0) for e in running]
    waiting = sorted((e for e in entries if not e.running), key=lambda e: e.order)
    ends = share_ends(remaining, [work(e) for e in waiting], speed, slots, now)
    places = {e.batch_id: Place(0, round(end)) for e, end in zip(running, ends, strict=False)}
    for position, (e, end) in enumerate(zip(waiting, ends[len(running):], strict=True), start=1):
        places[e.batch_id] = Place(position, round(end))
    return places


@dataclass(frozen=True)
class Moved:
    """A batch whose stored place or estimated end changed."""

    batch_id: str
    run_id: str | None
    place: Place
    new_position: bool  # its queue_position changed (not only its estimated end)


def meets_deadline(estimated_completion_at: int | None, expires_at: int | None) -> bool | None:
    """Whether a batch's estimated end is at or before its deadline; None without either."""
    if estimated_completion_at is None or expires_at is None:
        return None
    return estimated_completion_at <= expires_at


@dataclass(frozen=True)
class Refreshed:
    """What a refresh of the queue changed: the batches whose place or end moved, and those it found will miss their
    deadline for the first time (each one's batch.deadline_at_risk event is written)."""

    moved: list[Moved]
    at_risk: list[Moved]


def refresh_queue(session: Session, *, slots: int, default_tokens_per_s: float, now: float) -> Refreshed:
    """Recompute every not-ended batch's queue position and estimated end, per model; store those that changed, and
    flag (once, with its event) each batch whose end is now estimated after its deadline; committed."""
    rows = session.execute(
        # A batch whose uploaded input was deleted is still queued: its folder's copy of the input is its size.
        select(BatchRecord, func.coalesce(FileRecord.bytes, BatchRecord.stored_bytes, 0))
        .outerjoin(FileRecord, FileRecord.id == BatchRecord.input_file_id)
        .where(BatchRecord.status.in_(NOT_ENDED))).all()
    by_model: dict[str | None, list[tuple[BatchRecord, int]]] = defaultdict(list)
    for batch, nbytes in rows:
        by_model[batch.model].append((batch, nbytes))
    waits = start_delays(session, now)  # a warm fleet asleep or starting: its replicas' start comes first
    moved, changes, at_risk = [], [], []
    for model, batches in by_model.items():
        entries = [Entry(
            batch_id=b.id, running=b.status != BatchStatus.VALIDATING,
            order=launch_order(b.options.priority, b.launch_priority, b.pk, b.expires_at),
            work=bounded_work(b.estimate),
            input_bytes=nbytes,
            done=(b.request_completed + b.request_failed) / b.request_total if b.request_total else 0.0,
            in_progress_at=b.in_progress_at) for b, nbytes in batches]
        places = plan(entries, queue_throughput(session, model, default_tokens_per_s), slots,
                      now + waits.get(model or "", 0.0))
        for b, _ in batches:
            place = places[b.id]
            if (b.queue_position, b.estimated_completion_at) != (place.queue_position, place.estimated_completion_at):
                moved.append(Moved(b.id, b.run_id, place, b.queue_position != place.queue_position))
                # The first end it is given stays: the metrics' ETA error is measured against it.
                first = b.first_estimated_completion_at or place.estimated_completion_at
                changes.append({"pk": b.pk, "queue_position": place.queue_position,
                                "estimated_completion_at": place.estimated_completion_at,
                                "first_estimated_completion_at": first})
            if b.deadline_at_risk_at is None and meets_deadline(place.estimated_completion_at, b.expires_at) is False \
                    and _flag_at_risk(session, b, round(now)):
                at_risk.append(Moved(b.id, b.run_id, place, False))
    if changes:
        # One statement for all (executemany by primary key): a batch that ended meanwhile keeps a stale place,
        # which the API does not show once it has ended.
        session.execute(update(BatchRecord), changes)
    session.commit()
    return Refreshed(moved, at_risk)


def _flag_at_risk(session: Session, batch: BatchRecord, at: int) -> bool:
    """Mark the batch at risk of missing its deadline and write its event, unless it ended or was marked meanwhile:
    one event per batch, whoever refreshes the queue."""
    result = cast(CursorResult, session.execute(
        update(BatchRecord).where(BatchRecord.pk == batch.pk, BatchRecord.deadline_at_risk_at.is_(None),
                                  BatchRecord.status.in_(NOT_ENDED)).values(deadline_at_risk_at=at)))
    if result.rowcount != 1:
        return False
    add_event(session, batch.id, batch.owner, DEADLINE_AT_RISK, at)
    return True


def set_launch_priorities(session: Session, priorities: dict[str, int]) -> None:
    """Record each launched batch's run priority (its dagster/priority tag): its place in the launch order."""
    for batch_id, priority in priorities.items():
        session.execute(update(BatchRecord).where(BatchRecord.id == batch_id).values(launch_priority=priority))
    session.commit()


@dataclass
class RunningEta:
    """A running batch's end as its own run sees it: what it finished since `started` (of its `total` requests, after
    `done_before` finished by an earlier attempt) blended with its estimate's work at the estimate's measured rate
    (running_remaining_s), the arithmetic of the stored estimated_completion_at."""

    work: float  # the estimate's bounded tokens (0: no estimate)
    tokens_per_s: float  # the estimate's measured rate (0: none)
    total: int = 1
    done_before: int = 0
    started: float = field(default_factory=time.time)

    @classmethod
    def of(cls, estimate: dict[str, Any] | None, total: int, done_before: int = 0) -> RunningEta:
        return cls(bounded_work(estimate) or 0.0, float((estimate or {}).get("tokens_per_s") or 0.0),
                   max(total, 1), done_before)

    def remaining_s(self, done: int, now: float) -> float | None:
        """Seconds left once `done` requests in all have finished; None while there is nothing to say (no rate and
        nothing done)."""
        if done <= 0 and self.tokens_per_s <= 0:
            return None
        share = max(1 - self.done_before / self.total, 1e-9)  # the part of the batch this run works through
        # Its time counts from this run's start, its fraction over the requests it finished (not those before).
        ran = (done - self.done_before) / self.total / share
        return running_remaining_s(self.work * share, self.tokens_per_s, ran, now - self.started)
