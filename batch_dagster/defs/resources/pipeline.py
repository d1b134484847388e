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
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.batchfile.usage import PriceTable, load_price_table


class PipelineConfig(dg.ConfigurableResource):
    """How batches are cut and checked, and what they cost."""

    shard_size: int = s.default("BATCH_SHARD_SIZE")
    max_requests: int = s.default("BATCH_MAX_REQUESTS")
    max_bytes: int = s.default("BATCH_MAX_BYTES")
    max_line_bytes: int = s.default("BATCH_MAX_LINE_BYTES")
    prices_file: str = str(s.default("BATCH_PRICES_FILE"))
    max_enqueued_tokens: int | None = s.default("BATCH_MAX_ENQUEUED_TOKENS")  # per owner and model; 0, None: no limit
    # The metadata store: its unfinished batches count toward that limit; the cost cap and the estimate read it too.
    store_url: str = ""
    key_daily_budget: float | None = s.default("BATCH_KEY_DAILY_BUDGET")  # the cost cap's; None: no budget
    estimate_tokens_per_s: float = s.default("BATCH_ESTIMATE_TOKENS_PER_S")  # a validated batch's estimate
    # Image parts: the hosts their http(s) URLs may name (fetched once per batch), the bytes of one image, and the
    # internal addresses a fetch may reach (the webhooks' allow-list).
    image_hosts: list[str] = list(s.default("BATCH_IMAGE_HOSTS"))
    max_image_bytes: int = s.default("BATCH_MAX_IMAGE_BYTES")
    fetch_allow: list[str] = list(s.default("BATCH_WEBHOOK_ALLOW"))

    @property
    def limits(self) -> Limits:
        return Limits(max_requests=self.max_requests, max_bytes=self.max_bytes, max_line_bytes=self.max_line_bytes)

    @property
    def image_sources(self) -> ImageSources:
        return ImageSources.of(self.image_hosts, self.max_image_bytes)

    def prices(self) -> PriceTable:
        return load_price_table(Path(self.prices_file))


def env_or(name: str, value: Any) -> Any:
    """`value` (the setting), or, when its variable is set, a `dg.EnvVar` of it, so the UI names the variable."""
    if not s.is_set(name):
        return value
    return dg.EnvVar.int(name) if isinstance(value, int) else dg.EnvVar(name)


def pipeline_config_from_env(settings: s.Settings) -> PipelineConfig:
    return PipelineConfig(
        shard_size=env_or("BATCH_SHARD_SIZE", settings.shard_size),
        max_requests=env_or("BATCH_MAX_REQUESTS", settings.max_requests),
        max_bytes=env_or("BATCH_MAX_BYTES", settings.max_bytes),
        max_line_bytes=env_or("BATCH_MAX_LINE_BYTES", settings.max_line_bytes),
        prices_file=env_or("BATCH_PRICES_FILE", str(settings.prices_file)),
        # Set to 0 it is no limit: an int either way, which EnvVar.int reads.
        max_enqueued_tokens=dg.EnvVar.int("BATCH_MAX_ENQUEUED_TOKENS") if s.is_set("BATCH_MAX_ENQUEUED_TOKENS")
        else settings.max_enqueued_tokens,
        store_url=env_or("BATCH_DATABASE_URL", settings.database_url),
        key_daily_budget=settings.key_daily_budget,  # a float: EnvVar reads strings and ints only
        estimate_tokens_per_s=settings.estimate_tokens_per_s,
        image_hosts=list(settings.image_hosts),
        max_image_bytes=env_or("BATCH_MAX_IMAGE_BYTES", settings.max_image_bytes),
        fetch_allow=list(settings.webhook_allow),
    )
