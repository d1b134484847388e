"""Where a batch is in its model's queue and when it will end: the arithmetic over the batches not ended yet.

A batch's work is its estimate's bounded tokens (input tokens and most output tokens, batchfile/estimate.py);
before validation (a queued batch is validated when its run starts) its input file's bytes times the tokens per
byte of the model's recent batches. The rate is that same work per second of the model's recent batches, over the
time one of them at least was running (from validated to completed), so the bound's slack (requests that stop
early) and the pipeline's own time are in it; the batches running at once share it.
The store gathers the numbers (db/eta.py); the daemon's queue_eta_sensor stores what this computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Work per input byte before any batch of the model was validated: a first guess that measurement replaces.
DEFAULT_TOKENS_PER_BYTE = 0.5


@dataclass(frozen=True)
class Rate:
    """A model's pace: bounded tokens per second of a batch's run, and bounded tokens per input byte."""

    tokens_per_s: float  # of the model's engine, shared by the batches running at once
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


def plan(entries: list[Entry], rate: Rate, slots: int, now: float) -> dict[str, Place]:
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


def busy_s(intervals: list[tuple[float, float]]) -> float:
    """The seconds at least one of the intervals (start, end) covers."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
