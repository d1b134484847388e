"""Fair queueing: the order batch runs launch in, as a number the run queue sorts by (its `dagster/priority`).

Runs launch by `dagster/priority` (launch_priority): the batch's own priority first; then, within a priority, the
earliest deadline first, each step of its fair rank (fair_ranks) counting as RANK_DEADLINE_S more of deadline: among
batches submitted within minutes of each other, one key's backlog waits behind the first batch of a key that arrives
later, which waits for one run slot of its model at most, while a batch due hours sooner goes ahead of them all.
Each model and each batch priority keeps its own fair clock: runs of another model take other slots, and runs of
another priority are ordered by that priority first, so neither says how far this queue has moved.
The Dagster side (the runs the queue holds, the tags) is defs/fairness.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

# A run's launch priority is the batch's own priority (-10..10) times PRIORITY_STEP (more than deadlines and ranks
# span), plus its deadline term (deadline_term: seconds before NO_DEADLINE), plus its fair rank times RANK_DEADLINE_S.
# What one step of fair rank weighs in deadline: keys' batches submitted less than this apart interleave (#18); a
# 1h batch goes ahead of 24h batches whatever their keys' backlogs (up to 23 h of them: 138 ranks).
RANK_DEADLINE_S = 600
NO_DEADLINE = 2**31  # past every deadline the store holds (MAX_UNIX_S): a batch with none goes last
PRIORITY_STEP = 10**12


def deadline_term(expires_at: int | None) -> int:
    """The deadline's part of a run's dagster/priority: higher for an earlier deadline (its batch's expires_at, in
    seconds); 0, the lowest, for none (as a run with no tag, the command line's)."""
    return NO_DEADLINE - min(expires_at if expires_at is not None else NO_DEADLINE, NO_DEADLINE)


def launch_priority(rank: int, priority: int, expires_at: int | None = None) -> int:
    """A run's dagster/priority: its batch's own priority first, then its deadline (deadline_term) less
    RANK_DEADLINE_S per step of its fair rank (fair_ranks, 0 or below)."""
    return priority * PRIORITY_STEP + deadline_term(expires_at) + rank * RANK_DEADLINE_S


@dataclass(frozen=True)
class InFlight:
    """A run the queue holds or runs: its owner's label, its fair rank, whether it has left the queue, and the
    queue it waits in (its model and its batch's priority: each keeps its own fair clock)."""

    owner: str
    rank: int
    started: bool
    queue: Hashable = ""


def fair_ranks(in_flight: Iterable[InFlight], owners: Sequence[str],
               queues: Sequence[Hashable] | None = None) -> list[int]:
    """The fair ranks of new runs of `owners` (in the order they are submitted; each in its `queues` entry, one
    queue when not given), so that each queue interleaves owners; a higher rank goes first.

    Start-time fair queueing, in each queue on its own: a run's turn is its rank's negative. The queue's clock is
    the latest turn that has started in it. A new run takes the clock's turn, or the turn after its owner's last
    run in flight in that queue when that is later. So an owner's runs keep their order, a backlog of n runs spreads
    over the next n turns, and an owner with nothing in flight goes ahead of every run whose turn is past the clock:
    it waits at most for the runs in the slots. Another queue's runs never move this queue's clock.
    """
    runs = list(in_flight)
    started: dict[Hashable, int] = {}
    earliest: dict[Hashable, int] = {}
    last: dict[tuple[Hashable, str], int] = {}
    for r in runs:
        turn = -r.rank
        if r.started:
            started[r.queue] = max(started.get(r.queue, turn), turn)
        earliest[r.queue] = min(earliest.get(r.queue, turn), turn)
        last[r.queue, r.owner] = max(last.get((r.queue, r.owner), turn), turn)
    ranks = []
    for owner, queue in zip(owners, queues if queues is not None else [""] * len(owners), strict=True):
        clock = started.get(queue, earliest.get(queue, 0))
        turn = max(clock, last[queue, owner] + 1) if (queue, owner) in last else clock
        last[queue, owner] = turn
        ranks.append(-turn)
    return ranks


def own_priority(launch: int, rank: int) -> int:
    """The batch's own priority in a run's dagster/priority (launch_priority's inverse: its deadline term and fair
    rank together span less than half a PRIORITY_STEP)."""
    return round((launch - rank * RANK_DEADLINE_S) / PRIORITY_STEP)
