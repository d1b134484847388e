"""Every job, and the schedule that runs the daily report."""

import dagster as dg

from batch_dagster.assets.batch import lifecycle_assets
from batch_dagster.assets.daily_report import daily_usage_report
from batch_dagster.assets.delivery import delivered_results
from batch_dagster.run_queue import ENGINE_TAG, OFFLINE

batch_job = dg.define_asset_job(
    "batch_job",
    selection=dg.AssetSelection.assets(*lifecycle_assets),
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
)

daily_usage_report_job = dg.define_asset_job(
    "daily_usage_report_job",
    selection=dg.AssetSelection.assets(daily_usage_report),
    description="Build one day's usage report (the partition key is the UTC day).",
)

# Shortly after midnight UTC, for the day that just ended (the newest partition).
daily_usage_report_schedule = dg.build_schedule_from_partitioned_job(
    daily_usage_report_job,
    name="daily_usage_report_schedule",
    hour_of_day=0,
    minute_of_hour=15,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Builds yesterday's usage report at 00:15 UTC.",
)

all_jobs = [batch_job, deliver_results_job, daily_usage_report_job]
