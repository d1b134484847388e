"""The launch order of batch runs: owners interleaved by `dagster/priority` (defs/run_limits.py fair_priorities),
read from the runs the instance's queue holds or runs now."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dagster as dg

from batch_dagster.defs.run_limits import PRIORITY_TAG, InFlight, fair_priorities


def with_fair_priorities(instance: dg.DagsterInstance, job_name: str, tags: Sequence[dict[str, str]],
                         owner_tag: str) -> list[dict[str, str]]:
    """`tags` (of new runs of `job_name`, in submission order) each with the priority fair_priorities gives it, from
    the runs of the job the queue holds or runs now."""
    waiting = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED)
    runs = instance.get_runs(dg.RunsFilter(job_name=job_name, statuses=[*waiting, dg.DagsterRunStatus.STARTING,
                                                                        dg.DagsterRunStatus.STARTED]))
    in_flight = [InFlight(r.tags.get(owner_tag, ""), _priority(r.tags), r.status not in waiting) for r in runs]
    priorities = fair_priorities(in_flight, [t.get(owner_tag, "") for t in tags])
    return [{**t, PRIORITY_TAG: str(p)} for t, p in zip(tags, priorities, strict=True)]


def _priority(tags: Mapping[str, str]) -> int:
    try:
        return int(tags.get(PRIORITY_TAG, "0"))
    except ValueError:  # as the run queue reads it
        return 0
