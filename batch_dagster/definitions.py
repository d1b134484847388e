"""The Dagster definitions of batch-dagster: only merges what the other modules define."""

import dagster as dg

from batch_dagster.assets.batch import lifecycle_assets
from batch_dagster.assets.checks import lifecycle_checks
from batch_dagster.assets.delivery import deliver_results_job, delivered_results
from batch_dagster.assets.report import daily_usage_report_job, daily_usage_report_schedule, report_assets
from batch_dagster.intake import inbox_sensor, s3_upload_sensor
from batch_dagster.jobs import batch_job
from batch_dagster.resources.config import resources_from_env
from batch_dagster.resources.intake import intake_from_env
from batch_dagster.sensors import api_batch_sensor, api_batch_status_sensor
from batch_dagster.store.resource import api_store_from_env

defs = dg.Definitions(
    assets=[*lifecycle_assets, delivered_results, *report_assets],
    asset_checks=lifecycle_checks,
    jobs=[batch_job, deliver_results_job, daily_usage_report_job],
    schedules=[daily_usage_report_schedule],
    sensors=[api_batch_sensor, api_batch_status_sensor, s3_upload_sensor, inbox_sensor],
    resources={**resources_from_env(), "api_store": api_store_from_env(), "intake": intake_from_env()},
)
