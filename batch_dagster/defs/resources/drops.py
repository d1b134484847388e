"""Drop folders: where dropped files arrive (an S3 prefix, a local inbox), where their results go, and who owns
their batches."""

from __future__ import annotations

import dagster as dg

from batch_dagster.db import repo
from batch_dagster.settings import Settings, default


class Intake(dg.ConfigurableResource):
    """The drop locations. `owner` is the hashed API key the batches are listed under (see intake_from_env); empty
    when API keys are configured and none was chosen to own dropped files: the drop sensors then take none."""

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

    def no_owner(self) -> str | None:
        """Why the drop sensors take no file (no owner chosen for them), or None."""
        if self.owner:
            return None
        return ("Dropped files are left where they are: BATCH_API_KEYS is set but BATCH_INTAKE_API_KEY is not. "
                "Set it to the key whose owner the dropped files' batches belong to.")

    def s3_results_uri(self) -> str:
        return f"s3://{self.s3_bucket}/{self.s3_output_prefix}"


def intake_from_env(settings: Settings) -> Intake:
    """The drop locations and owner from the settings (BATCH_S3_*, BATCH_INBOX_DIR, BATCH_OUTBOX_DIR,
    BATCH_INTAKE_API_KEY)."""
    key = settings.intake_api_key
    # With keys, dropped files belong to the key the operator names, never to one picked for them.
    owner = repo.owner_of_key(key) if key else "" if settings.api_keys else repo.ANONYMOUS
    return Intake(
        s3_bucket=settings.s3_bucket,
        s3_prefix=settings.s3_prefix,
        s3_output_prefix=settings.s3_output_prefix,
        inbox_dir=str(settings.inbox_dir),
        outbox_dir=str(settings.outbox_dir),
        owner=owner,
        completion_window_s=settings.completion_window_s,
    )
