"""Every job: the batch's lifecycle, and the delivery of a dropped file's results (the daily report's job and
schedule are built with its partitions: assets/daily_report.py)."""

from __future__ import annotations

import dagster as dg

from batch_dagster.defs.assets.batch import LIFECYCLE
from batch_dagster.defs.assets.delivery import delivered_results
from batch_dagster.defs.run_limits import ENGINE_TAG, OFFLINE

BATCH_JOB = "batch_job"


def batch_executor(name: str) -> dg.ExecutorDefinition:
    """How batch_job runs its steps (BATCH_EXECUTOR).

    By default in the run's own process: the lifecycle is a chain with nothing to run in parallel, and a
    process per step (Dagster's default) would load the code location again for each of the nine steps,
    seconds each, which is most of a small batch's time. Crash safety does not depend on it: a step that
    raises is retried in place (shard_results' RetryPolicy), and a run whose process dies is retried as a new
    run that skips the committed shards (dagster.yaml run_retries). On Kubernetes, `k8s` runs each step in its
    own pod, so that only the inference step's pod asks for a GPU (batch_dagster/defs/k8s.py).
    """
    if name == "in_process":
        return dg.in_process_executor
    if name == "multiprocess":
        return dg.multiprocess_executor
    if name == "k8s":
        from dagster_k8s import k8s_job_executor  # the `k8s` extra

        return k8s_job_executor
    raise ValueError(f"BATCH_EXECUTOR {name!r} is not one of in_process, multiprocess, k8s")


# Its executor is the definitions' (batch_executor of BATCH_EXECUTOR, read when they load: defs/definitions.py).
batch_job = dg.define_asset_job(
    BATCH_JOB,
    selection=dg.AssetSelection.assets(*LIFECYCLE),
    description="Validate, shard, infer, merge and price one batch (the partition key is the batch id).",
    # The run queue's limits count runs by these tags. The sensors tag each run by its model; a run launched
    # without them (the UI's launchpad, a job backfill) is counted as holding an engine: the safe guess. As
    # `tags`, not `run_tags`: job backfills copy only a job's definition tags, and these serve as both.
    tags={ENGINE_TAG: OFFLINE},
)

deliver_results_job = dg.define_asset_job(
    "deliver_results_job",
    selection=[delivered_results],
    description="Write a dropped file's results back beside it (started by the S3 and inbox sensors).",
    executor_def=dg.multi_or_in_process_executor,  # Dagster's default, whatever batch_job's is
)
