"""Drop folders: where dropped files arrive (an S3 prefix, a local inbox) and where their results go. Who owns their
batches follows from a key (BATCH_INTAKE_API_KEY): the store resource, which holds the keys, says (`intake_owner`)."""

from __future__ import annotations

import dagster as dg

from batch_dagster.settings import Settings, default


class Intake(dg.ConfigurableResource):
    """The drop locations. Their owner is the store resource's to say (DatabaseResource.intake_owner): none
    when API keys are configured and none was chosen to own dropped files, and the drop sensors then take none."""

    s3_bucket: str = default("BATCH_S3_BUCKET")  # empty: the S3 sensor does nothing
    s3_prefix: str = default("BATCH_S3_PREFIX")
    s3_output_prefix: str = default("BATCH_S3_OUTPUT_PREFIX")
    inbox_dir: str
    outbox_dir: str
    completion_window_s: int = default("BATCH_COMPLETION_WINDOW_S")
    settle_s: float = 2.0  # an inbox file must be unchanged this long (and across two ticks) to be complete
    max_batches_per_tick: int = 20
    max_keys_per_tick: int = 1000

    def s3_results_uri(self) -> str:
        return f"s3://{self.s3_bucket}/{self.s3_output_prefix}"


def intake_from_env(settings: Settings) -> Intake:
    """The drop locations from the settings (BATCH_S3_*, BATCH_INBOX_DIR, BATCH_OUTBOX_DIR)."""
    return Intake(
        s3_bucket=settings.s3_bucket,
        s3_prefix=settings.s3_prefix,
        s3_output_prefix=settings.s3_output_prefix,
        inbox_dir=str(settings.inbox_dir),
        outbox_dir=str(settings.outbox_dir),
        completion_window_s=settings.completion_window_s,
    )
