"""The pipeline's knobs as a Dagster resource: shard size, file limits, prices, retries, shown in the UI."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from batch_dagster.batchfile.contract import Limits
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.usage import PriceTable, load_price_table

from .setting_fields import setting


class PipelineConfig(dg.ConfigurableResource):
    """How batches are cut, checked and retried, what they cost, and how their estimate counts time."""

    shard_size: int = setting("BATCH_SHARD_SIZE")
    max_requests: int = setting("BATCH_MAX_REQUESTS")
    max_bytes: int = setting("BATCH_MAX_BYTES")
    max_line_bytes: int = setting("BATCH_MAX_LINE_BYTES")
    prices_file: str = setting("BATCH_PRICES_FILE")
    max_enqueued_tokens: int | None = setting("BATCH_MAX_ENQUEUED_TOKENS")  # per owner and model; 0, None: no limit
    key_daily_budget: float | None = setting("BATCH_KEY_DAILY_BUDGET")
    error_breaker_lines: int = setting("BATCH_ERROR_BREAKER_LINES")
    error_breaker_rate: float | None = setting("BATCH_ERROR_BREAKER_RATE")
    estimate_tokens_per_s: float = setting("BATCH_ESTIMATE_TOKENS_PER_S")
    # The ETA's runs of one model at once when the instance's run queue has no such limit (a test's instance).
    runs_per_model: int = setting("BATCH_RUNS_PER_MODEL")
    reuse_answers: bool = setting("BATCH_REUSE_ANSWERS")  # a batch whose `reuse` option is unset
    answer_store_bytes: int = setting("BATCH_ANSWER_STORE_BYTES")
    # What owners share (answers, prompt prefixes; nothing when empty), and the secret their prefix-cache salts take.
    shared_owners: list[str] = setting("BATCH_SHARED_OWNERS")
    cache_salt_secret: str = setting("BATCH_CACHE_SALT_SECRET")
    # Image parts: the hosts their http(s) URLs may name (fetched once per batch), the bytes of one image, the
    # internal addresses a fetch may reach (the webhooks' allow-list), and what one batch may fetch in all.
    image_hosts: list[str] = setting("BATCH_IMAGE_HOSTS")
    max_image_bytes: int = setting("BATCH_MAX_IMAGE_BYTES")
    fetch_allow: list[str] = setting("BATCH_WEBHOOK_ALLOW")
    image_budget_bytes: int = setting("BATCH_IMAGE_BUDGET_BYTES")
    image_budget_s: float = setting("BATCH_IMAGE_BUDGET_S")
    # A key's stored bytes, its fetched images counted as they are kept (features/quotas.py).
    key_max_stored_bytes: int | None = setting("BATCH_KEY_MAX_STORED_BYTES")

    @property
    def limits(self) -> Limits:
        return Limits.of(self)

    def option_defaults(self) -> BatchOptions:
        """The operator's defaults of a batch's options (batchfile/options.py BatchOptions.resolved)."""
        return BatchOptions(reuse=self.reuse_answers, error_breaker_rate=self.error_breaker_rate)

    @property
    def image_sources(self) -> ImageSources:
        return ImageSources.of(self.image_hosts, self.max_image_bytes)

    def prices(self) -> PriceTable:
        return load_price_table(Path(self.prices_file))
