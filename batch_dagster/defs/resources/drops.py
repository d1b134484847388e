"""Drop folders as a Dagster resource: where dropped files arrive (an S3 prefix, a local inbox) and where their
results go. The store resource says who owns their batches (`intake_owner`), since it holds the keys."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from batch_dagster.batchfile.windows import CompletionWindows, Window

from .setting_fields import setting


class Intake(dg.ConfigurableResource):
    """The drop locations. Their owner is the store resource's to say (DatabaseResource.intake_owner): none
    when API keys are configured and none was chosen to own dropped files, and the drop sensors then take none."""

    s3_bucket: str = setting("BATCH_S3_BUCKET")  # empty: the S3 sensor does nothing
    s3_prefix: str = setting("BATCH_S3_PREFIX")
    s3_output_prefix: str = setting("BATCH_S3_OUTPUT_PREFIX")
    inbox_dir: str = setting("BATCH_INBOX_DIR")
    outbox_dir: str = setting("BATCH_OUTBOX_DIR")
    completion_windows: list[str] = setting("BATCH_COMPLETION_WINDOWS")  # a dropped file's batch takes the longest
    settle_s: float = 2.0  # an inbox file must be unchanged this long (and across two ticks) to be complete
    max_batches_per_tick: int = 20
    max_keys_per_tick: int = 1000

    def window(self) -> Window:
        """The completion window of a dropped file's batch."""
        return CompletionWindows.of(self.completion_windows).default

    def s3_results_uri(self) -> str:
        return f"s3://{self.s3_bucket}/{self.s3_output_prefix}"

    def results_uri(self, scheme: str) -> str:
        """Where the results of the files dropped under `scheme` go: the bucket's results prefix, or the outbox."""
        return self.s3_results_uri() if scheme == "s3://" else Path(self.outbox_dir).resolve().as_uri()
