"""The Dagster definitions of batch-dagster: only merges what the modules beside it define."""

import dagster as dg

from batch_dagster.defs.assets.batch import lifecycle_assets
from batch_dagster.defs.assets.checks import lifecycle_checks
from batch_dagster.defs.assets.daily_report import report_assets
from batch_dagster.defs.assets.delivery import delivered_results
from batch_dagster.defs.jobs import all_jobs, daily_usage_report_schedule
from batch_dagster.defs.resources.from_env import resources_from_env
from batch_dagster.defs.sensors import all_sensors

defs = dg.Definitions(
    assets=[*lifecycle_assets, delivered_results, *report_assets],
    asset_checks=lifecycle_checks,
    jobs=all_jobs,
    schedules=[daily_usage_report_schedule],
    sensors=all_sensors,
    resources=resources_from_env(),
)
