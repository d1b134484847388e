"""Where dropped files arrive (an S3 prefix, a local inbox), where their results go, and who owns their batches."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from batch_dagster.settings import Settings, api_keys_from_env
from batch_dagster.store import repo

DAY_S = 24 * 3600


class Intake(dg.ConfigurableResource):
    """The drop locations. `owner` is the hashed API key the batches are listed under (see intake_from_env)."""

    s3_bucket: str = ""  # empty: the S3 sensor does nothing
    s3_prefix: str = "incoming/"
    s3_output_prefix: str = "results/"
    inbox_dir: str
    outbox_dir: str
    files_dir: str
    owner: str = repo.ANONYMOUS
    completion_window_s: int = DAY_S
    settle_s: float = 2.0  # an inbox file must be unchanged this long (and across two ticks) to be complete
    max_batches_per_tick: int = 20
    max_keys_per_tick: int = 1000

    def s3_results_uri(self) -> str:
        return f"s3://{self.s3_bucket}/{self.s3_output_prefix}"


def intake_from_env() -> Intake:
    """BATCH_S3_BUCKET, BATCH_S3_PREFIX, BATCH_S3_OUTPUT_PREFIX, BATCH_INBOX_DIR, BATCH_OUTBOX_DIR,
    BATCH_INTAKE_API_KEY (default: the first of BATCH_API_KEYS; none: the keyless loopback owner)."""
    settings = Settings.from_env()
    inbox = Path(os.environ.get("BATCH_INBOX_DIR") or settings.data_dir / "inbox")
    keys = api_keys_from_env()
    key = os.environ.get("BATCH_INTAKE_API_KEY") or (keys[0] if keys else "")
    return Intake(
        s3_bucket=os.environ.get("BATCH_S3_BUCKET", ""),
        s3_prefix=os.environ.get("BATCH_S3_PREFIX", "incoming/"),
        s3_output_prefix=os.environ.get("BATCH_S3_OUTPUT_PREFIX", "results/"),
        inbox_dir=str(inbox),
        outbox_dir=os.environ.get("BATCH_OUTBOX_DIR") or str(inbox.parent / "outbox"),
        files_dir=str(settings.data_dir / "files"),
        owner=repo.owner_of_key(key) if key else repo.ANONYMOUS,
        completion_window_s=int(os.environ.get("BATCH_COMPLETION_WINDOW_S") or DAY_S),
    )
