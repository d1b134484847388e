"""Where a batch is in its model's queue and when it will end: the arithmetic over the batches not ended yet.

A batch's work is its estimate's bounded tokens (input tokens and most output tokens, batchfile/estimate.py);
before validation (a queued batch is validated when its run starts) its input file's bytes times the tokens per
byte of the model's recent batches. The rate is that same work per second of the model's recent batches, from
validated to completed, so the bound's slack (requests that stop early) and the pipeline's own time are in it.
The store gathers the numbers (db/eta.py); the daemon's queue_eta_sensor stores what this computes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

# Work per input byte before any batch of the model was validated: a first guess that measurement replaces.
DEFAULT_TOKENS_PER_BYTE = 0.5


@dataclass(frozen=True)
class Rate:
    """A model's pace: bounded tokens per second of a batch's run, and bounded tokens per input byte."""

    tokens_per_s: float
    tokens_per_byte: float = DEFAULT_TOKENS_PER_BYTE
    batches: int = 0  # the recent batches measured; 0: the defaults


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


def bounded_work(estimate: dict[str, Any] | None) -> float | None:
    """A validated batch's work in bounded tokens: its input tokens and most output tokens (None: not known)."""
    if not isinstance(estimate, dict):
        return None
    tokens, most = estimate.get("input_tokens"), estimate.get("max_output_tokens")
    if not isinstance(tokens, int) or not isinstance(most, int):
        return None
    return float(tokens + most)


def launch_order(priority: int, launch_priority: int | None, pk: int) -> tuple[int, int, int, int]:
    """The run queue's order (defs/run_limits.py): the batch's priority first, then its run's dagster/priority
    (priority and fair rank; a batch not launched yet ranks after those launched), then submission order."""
    return -priority, 0 if launch_priority is not None else 1, -(launch_priority or 0), pk


def running_remaining_s(work: float, rate: float, done: float, elapsed_s: float) -> float:
    """Seconds left of a running batch: its remaining work at `rate`, blended with its own pace so far (elapsed
    over the fraction done), which counts more the further it is."""
    done = min(max(done, 0.0), 1.0)
    by_tokens = work * (1 - done) / rate if rate > 0 else 0.0
    if done <= 0 or elapsed_s <= 0:
        return by_tokens
    by_pace = elapsed_s * (1 - done) / done
    return done * by_pace + (1 - done) * by_tokens


def plan(entries: list[Entry], rate: Rate, slots: int, now: float) -> dict[str, Place]:
    """Each batch's place and estimated end: the running ones from their progress; then the waiting ones in
    launch order, each taking the first of the model's `slots` (BATCH_RUNS_PER_MODEL) to come free."""
    speed = max(rate.tokens_per_s, 1e-9)

    def work(e: Entry) -> float:
        return e.work if e.work is not None else e.input_bytes * rate.tokens_per_byte

    places: dict[str, Place] = {}
    free: list[float] = []
    for e in entries:
        if e.running:
            elapsed = now - e.in_progress_at if e.in_progress_at is not None else 0.0
            end = now + running_remaining_s(work(e), speed, e.done, elapsed)
            places[e.batch_id] = Place(0, round(end))
            free.append(end)
    free.sort()
    free = free[len(free) - slots:] if len(free) >= slots else [now] * (slots - len(free)) + free
    heapq.heapify(free)
    waiting = sorted((e for e in entries if not e.running), key=lambda e: e.order)
    for position, e in enumerate(waiting, start=1):
        start = max(heapq.heappop(free), now)
        end = start + work(e) / speed
        heapq.heappush(free, end)
        places[e.batch_id] = Place(position, round(end))
    return places
