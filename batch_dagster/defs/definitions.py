"""The Dagster definitions of batch-dagster, built when Dagster loads them, never at import: this module only merges
what the modules beside it define, with the settings of the environment at that moment."""

import dagster as dg

from batch_dagster.defs import eta, retention, sensors, webhooks
from batch_dagster.defs.assets.batch import lifecycle
from batch_dagster.defs.assets.checks import lifecycle_checks
from batch_dagster.defs.assets.daily_report import report_definitions
from batch_dagster.defs.assets.delivery import delivered_results
from batch_dagster.defs.jobs import batch_executor, batch_job, deliver_results_job
from batch_dagster.defs.partitions import report_start
from batch_dagster.defs.resources.from_env import resources_from_env
from batch_dagster.settings import Settings


def build_definitions(settings: Settings) -> dg.Definitions:
    """Every asset, check, job, schedule, sensor and resource, as `settings` configure them."""
    batches = dg.Definitions(
        assets=[*lifecycle(settings.step_retry_delay_s), delivered_results],
        asset_checks=lifecycle_checks,
        jobs=[batch_job, deliver_results_job],
        executor=batch_executor(settings.executor),  # batch_job's: the other jobs name their own
        sensors=[sensors.api_batch_sensor, sensors.api_batch_status_sensor, eta.queue_eta_sensor,
                 sensors.s3_sensor(bool(settings.s3_bucket)), sensors.inbox_sensor, sensors.file_expiry_sensor,
                 retention.history_retention_sensor, webhooks.webhook_sensor],
        resources=resources_from_env(settings),
    )
    return dg.Definitions.merge(batches, report_definitions(report_start(settings)))


@dg.definitions
def defs() -> dg.Definitions:
    """The code location's definitions (workspace.yaml, `dagster dev -m batch_dagster.definitions`), from the
    environment when Dagster loads them."""
    return build_definitions(Settings.from_env())
