"""What the cost cap asks the store: a batch's max_cost, and what its key's other batches of the day have spent."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.usage import PriceTable, Usage, cost_of
from batch_dagster.features.cost_cap import Cap
from batch_dagster.features.daily_usage import day_bounds

from .lifecycle import observe
from .models import BatchRecord


def spent_today(session: Session, storage: Storage, owner: str, prices: PriceTable, at: float,
                excluding: str) -> float:
    """The cost of `owner`'s batches created on the UTC day of `at` (epoch seconds), but `excluding`: an ended
    batch's as its row stores it, a running one's from its committed shards (as the API shows it; fresher than the
    row, which the status sensor updates every few seconds)."""
    start, end = day_bounds(datetime.fromtimestamp(at, UTC).date())
    rows = session.scalars(select(BatchRecord).where(
        BatchRecord.owner == owner, BatchRecord.id != excluding, BatchRecord.created_at >= start,
        BatchRecord.created_at < end))
    total = 0.0
    for row in rows:
        if row.status in TERMINAL:
            usage = Usage.from_dict(row.usage) if row.usage else None
        else:
            usage = observe(BatchFolder(storage, row.id)).usage
        if usage is not None and row.model:
            total += cost_of(usage, row.model, prices).total_cost
    return round(total, 8)


def batch_cap(session: Session, storage: Storage, batch_id: str, prices: PriceTable, currency: str,
              daily_budget: float | None, at: float) -> Cap | None:
    """What caps `batch_id`'s spend at `at`; None when nothing does (no max_cost, no budget) or it has no row."""
    row = session.scalar(select(BatchRecord).where(BatchRecord.id == batch_id))
    if row is None or (row.options.max_cost is None and daily_budget is None):
        return None
    spent = spent_today(session, storage, row.owner, prices, at, batch_id) if daily_budget is not None else 0.0
    return Cap(max_cost=row.options.max_cost, daily_budget=daily_budget, spent_today=spent, currency=currency)
