"""Fair queueing's Dagster side: each new run's fair rank (features/fairness.py fair_ranks, from the runs the
instance's queue holds or runs now, in its model's and priority's own queue) and its `dagster/priority`, which puts
its batch's own priority first, then its deadline (the earliest first)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dagster as dg

from batch_dagster.defs.run_limits import MODEL_TAG
from batch_dagster.features.fairness import InFlight, fair_ranks, launch_priority, own_priority

PRIORITY_TAG = "dagster/priority"  # the run queue launches higher first, and in submission order among equals
RANK_TAG = "fair_rank"  # a run's fair rank (fair_ranks), tagged beside its dagster/priority (launch_priority)


def with_launch_order(instance: dg.DagsterInstance, job_name: str, tags: Sequence[dict[str, str]],
                      owner_tag: str, priorities: Sequence[int] | None = None,
                      deadlines: Sequence[int | None] | None = None) -> list[dict[str, str]]:
    """`tags` (of new runs of `job_name`, in submission order) each with its fair rank (fair_ranks, from the runs
    of the job the queue holds or runs now) and its launch priority: the batch's own `priorities` (0 each when not
    given) first, then its deadline (its batch's expires_at in `deadlines`; None: none), then that rank."""
    waiting = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED)
    runs = instance.get_runs(dg.RunsFilter(job_name=job_name, statuses=[*waiting, dg.DagsterRunStatus.STARTING,
                                                                        dg.DagsterRunStatus.STARTED]))
    in_flight = [InFlight(r.tags.get(owner_tag, ""), _rank(r.tags), r.status not in waiting, _queue(r.tags))
                 for r in runs]
    own = priorities if priorities is not None else [0] * len(tags)
    ranks = fair_ranks(in_flight, [t.get(owner_tag, "") for t in tags],
                       [(t.get(MODEL_TAG, ""), p) for t, p in zip(tags, own, strict=True)])
    due = deadlines if deadlines is not None else [None] * len(tags)
    return [{**t, RANK_TAG: str(rank), PRIORITY_TAG: str(launch_priority(rank, p, w))}
            for t, rank, p, w in zip(tags, ranks, own, due, strict=True)]


def _queue(tags: Mapping[str, str]) -> tuple[str, int]:
    """The fair queue a run waits in: its model, and its batch's own priority (0 for a run tagged before it)."""
    try:
        launch = int(tags.get(PRIORITY_TAG, "0"))
    except ValueError:
        launch = 0
    return tags.get(MODEL_TAG, ""), own_priority(launch, _rank(tags)) if RANK_TAG in tags else 0


def _rank(tags: Mapping[str, str]) -> int:
    """A run's fair rank: its own tag, else (a run tagged before batch priorities) its whole priority."""
    try:
        return int(tags.get(RANK_TAG, tags.get(PRIORITY_TAG, "0")))
    except ValueError:  # as the run queue reads it
        return 0
