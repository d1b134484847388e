"""Every partitions definition: one partition per batch, one per UTC day from the daily report's first day."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime

import dagster as dg

from batch_dagster.features.retention import first_batch_created_at
from batch_dagster.settings import Settings


def report_start(settings: Settings) -> date:
    """The daily report's first day: BATCH_REPORT_START, else the UTC day of the store's first batch, else today.

    Partitions definitions are fixed when the definitions load (never at import), so the store is read then, once
    (one row, by primary key): every day before it would be a grey "missing" partition with nothing to report. A
    store with no batch yet (or unreachable) starts today, whose partition appears once the day is over.
    """
    if settings.report_start is not None:
        return settings.report_start
    created = first_batch_created_at(settings.database_url)
    return datetime.fromtimestamp(created if created is not None else time.time(), UTC).date()


# Each batch is one key; its key is the batch id.
BATCH_PARTITIONS = "batches"
batches = dg.DynamicPartitionsDefinition(name=BATCH_PARTITIONS)

def daily_partitions(start: date) -> dg.DailyPartitionsDefinition:
    """One partition per UTC day from `start` (report_start, when the definitions load). end_offset=0: the newest
    partition is yesterday, so today is never reported before it is over."""
    return dg.DailyPartitionsDefinition(start_date=start.isoformat(), timezone="UTC", end_offset=0)
