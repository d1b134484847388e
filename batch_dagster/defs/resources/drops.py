"""Drop folders: where dropped files arrive (an S3 prefix, a local inbox), where their results go, and who owns
their batches."""

from __future__ import annotations

import dagster as dg

from batch_dagster.db import repo
from batch_dagster.settings import Settings, default


class Intake(dg.ConfigurableResource):
    """The drop locations. `owner` is the hashed API key the batches are listed under (see intake_from_env)."""

    s3_bucket: str = default("BATCH_S3_BUCKET")  # empty: the S3 sensor does nothing
    s3_prefix: str = default("BATCH_S3_PREFIX")
    s3_output_prefix: str = default("BATCH_S3_OUTPUT_PREFIX")
    inbox_dir: str
    outbox_dir: str
    owner: str = repo.ANONYMOUS
    completion_window_s: int = default("BATCH_COMPLETION_WINDOW_S")
    settle_s: float = 2.0  # an inbox file must be unchanged this long (and across two ticks) to be complete
    max_batches_per_tick: int = 20
    max_keys_per_tick: int = 1000

    def s3_results_uri(self) -> str:
        return f"s3://{self.s3_bucket}/{self.s3_output_prefix}"


def intake_from_env(settings: Settings) -> Intake:
    """The drop locations and owner from the settings (BATCH_S3_*, BATCH_INBOX_DIR, BATCH_OUTBOX_DIR,
    BATCH_INTAKE_API_KEY)."""
    key = settings.intake_api_key
    return Intake(
        s3_bucket=settings.s3_bucket,
        s3_prefix=settings.s3_prefix,
        s3_output_prefix=settings.s3_output_prefix,
        inbox_dir=str(settings.inbox_dir),
        outbox_dir=str(settings.outbox_dir),
        owner=repo.owner_of_key(key) if key else repo.ANONYMOUS,
        completion_window_s=settings.completion_window_s,
    )
