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
    reuse_answers: bool = s.default("BATCH_REUSE_ANSWERS")  # a batch that does not say whether it reuses answers
    answer_store_bytes: int = s.default("BATCH_ANSWER_STORE_BYTES")  # the answer store's bound, oldest out first

    @property
    def limits(self) -> Limits:
        return Limits(max_requests=self.max_requests, max_bytes=self.max_bytes, max_line_bytes=self.max_line_bytes)

    def prices(self) -> PriceTable:
        return load_price_table(Path(self.prices_file))


def env_or(name: str, value: Any) -> Any:
    """`value` (the setting), or, when its variable is set, a `dg.EnvVar` of it, so the UI names the variable."""
    if not s.is_set(name):
        return value
    return dg.EnvVar.int(name) if isinstance(value, int) else dg.EnvVar(name)


def pipeline_config_from_env(settings: s.Settings, store: bool = True) -> PipelineConfig:
    """The pipeline's knobs; `store` False: with no metadata store (a table batch's, which has no API key)."""
    return PipelineConfig(
        shard_size=env_or("BATCH_SHARD_SIZE", settings.shard_size),
        max_requests=env_or("BATCH_MAX_REQUESTS", settings.max_requests),
        max_bytes=env_or("BATCH_MAX_BYTES", settings.max_bytes),
        max_line_bytes=env_or("BATCH_MAX_LINE_BYTES", settings.max_line_bytes),
        prices_file=env_or("BATCH_PRICES_FILE", str(settings.prices_file)),
        # Set to 0 it is no limit: an int either way, which EnvVar.int reads.
        max_enqueued_tokens=dg.EnvVar.int("BATCH_MAX_ENQUEUED_TOKENS") if s.is_set("BATCH_MAX_ENQUEUED_TOKENS")
        else settings.max_enqueued_tokens,
        store_url=env_or("BATCH_DATABASE_URL", settings.database_url) if store else "",
        key_daily_budget=settings.key_daily_budget,  # a float: EnvVar reads strings and ints only
        estimate_tokens_per_s=settings.estimate_tokens_per_s,
        reuse_answers=settings.reuse_answers,  # a bool: EnvVar reads strings and ints only
        answer_store_bytes=env_or("BATCH_ANSWER_STORE_BYTES", settings.answer_store_bytes),
    )
