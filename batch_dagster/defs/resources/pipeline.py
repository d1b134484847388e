"""The pipeline's knobs as a Dagster resource: shard size, file limits and prices, shown in the UI.

A field comes from `dg.EnvVar` when its variable is set, so the UI names the variable; otherwise
it holds the documented default (batch_dagster/settings.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from batch_dagster import settings as s
from batch_dagster.batchfile.contract import Limits
from batch_dagster.batchfile.usage import PriceTable, load_price_table


class PipelineConfig(dg.ConfigurableResource):
    """How batches are cut and checked, and what they cost."""

    shard_size: int = 1000
    max_requests: int = Limits.max_requests
    max_bytes: int = Limits.max_bytes
    max_line_bytes: int = Limits.max_line_bytes
    prices_file: str = str(s.CONFIG_DIR / "prices.toml")
    max_enqueued_tokens: int = 0  # per owner and model; 0: no limit
    store_url: str = ""  # the metadata store whose unfinished batches count toward that limit

    @property
    def limits(self) -> Limits:
        return Limits(max_requests=self.max_requests, max_bytes=self.max_bytes, max_line_bytes=self.max_line_bytes)

    def prices(self) -> PriceTable:
        return load_price_table(Path(self.prices_file))


def _env_or(name: str, default: Any, *, number: bool = False) -> Any:
    if not s.is_set(name):
        return default
    return dg.EnvVar.int(name) if number else dg.EnvVar(name)


def pipeline_config_from_env(settings: s.Settings) -> PipelineConfig:
    return PipelineConfig(
        shard_size=_env_or("BATCH_SHARD_SIZE", settings.shard_size, number=True),
        max_requests=_env_or("BATCH_MAX_REQUESTS", settings.limits.max_requests, number=True),
        max_bytes=_env_or("BATCH_MAX_BYTES", settings.limits.max_bytes, number=True),
        max_line_bytes=_env_or("BATCH_MAX_LINE_BYTES", settings.limits.max_line_bytes, number=True),
        prices_file=_env_or("BATCH_PRICES_FILE", str(settings.prices_file)),
        max_enqueued_tokens=_env_or("BATCH_MAX_ENQUEUED_TOKENS", settings.max_enqueued_tokens or 0, number=True),
        store_url=_env_or("BATCH_DATABASE_URL", settings.database_url),
    )
