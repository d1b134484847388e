"""A batch's cost cap. A batch may spend up to its `max_cost`, and no more than what its key's daily budget has
left after the key's other batches of its day. Validation refuses a batch whose upper-bound cost is past that
(`refuse_over_cap`); a running batch stops before the shard after it reaches it (`cap_reached`).

A batch's day is the UTC day it was created on, for all it ever spends: the budget of a day bounds what the key's
batches created that day cost in all, whenever they run. So a batch that runs past midnight stays under its own day's
budget (it gets no fresh one), and the batches created on a day never share their budget with another day's.

Costs are those of usage.py: successful requests only, at the batch price. What the other batches spent is read
from the store, one query: an ended batch's final usage, and a running one's as its run records it after each
shard (db/lifecycle.py record_usage). No check reads another batch's folder. docs/http-api.md ("Cost cap") says
what each check compares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.failure import COST_LIMIT
from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.results import CommittedShard
from batch_dagster.batchfile.usage import PriceTable, Usage, cost_of
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.keys import own_daily_budget
from batch_dagster.db.lifecycle import record_usage
from batch_dagster.db.models import BatchRecord, priced_window

from .daily_usage import day_bounds
from .estimate import Tally
from .shards import Shard, ShardFeature

# Costs are rounded to 8 decimals (usage.Cost): a sum within this of the cap has reached it.
_EPSILON = 1e-8


@dataclass(frozen=True)
class Cap:
    """What bounds one batch's spend; None: that bound is not set."""

    max_cost: float | None = None
    daily_budget: float | None = None
    spent_that_day: float = 0.0  # by the key's other batches created the same UTC day
    currency: str = "USD"

    def allowance(self, spent: float = 0.0) -> float | None:
        """What the batch may still spend once it has spent `spent`; None: nothing caps it."""
        left = []
        if self.max_cost is not None:
            left.append(self.max_cost - spent)
        if self.daily_budget is not None:
            left.append(self.daily_budget - self.spent_that_day - spent)
        return min(left) if left else None

    def _limits(self) -> str:
        parts = []
        if self.max_cost is not None:
            parts.append(f"max_cost {self.max_cost:g}")
        if self.daily_budget is not None:
            parts.append(f"the key's daily budget {self.daily_budget:g}, of which {self.spent_that_day:g} is spent "
                         "by its other batches created the same UTC day")
        return " and ".join(parts) + f" ({self.currency})"

    def refusal(self, upper_bound: float) -> c.BatchError | None:
        """At validation: the error for a batch whose upper-bound cost is more than it may spend, else None."""
        allowed = self.allowance()
        if allowed is None or upper_bound <= allowed + _EPSILON:
            return None
        return c.BatchError(
            c.COST_LIMIT_EXCEEDED,
            f"This batch may cost up to {upper_bound:g} {self.currency} (every request that runs succeeding with its "
            f"most output tokens), more than the {max(allowed, 0.0):g} it may spend under {self._limits()}. Lower "
            "max_tokens, split the file, or raise max_cost.",
        )

    def reached(self, spent: float) -> bool:
        """While it runs: whether the batch, having spent `spent`, must not start another shard."""
        allowed = self.allowance(spent)
        return allowed is not None and allowed <= _EPSILON


def spent_on_day(session: Session, owner: str, prices: PriceTable, day: date, excluding: str) -> float:
    """The cost of `owner`'s batches created on the UTC `day`, but `excluding`, as the store holds their usage (one
    query): whatever day they spent it on."""
    start, end = day_bounds(day)
    rows = session.execute(select(BatchRecord.usage, BatchRecord.model, BatchRecord.completion_window,
                                  BatchRecord.expires_at).where(
        BatchRecord.owner == owner, BatchRecord.id != excluding, BatchRecord.created_at >= start,
        BatchRecord.created_at < end))
    total = 0.0
    for usage, model, window, expires_at in rows:
        if usage and model:
            total += cost_of(Usage.from_dict(usage), model, prices, priced_window(window, expires_at)).total_cost
    return round(total, 8)


def batch_cap(session: Session | None, batch_id: str, options: BatchOptions, prices: PriceTable, currency: str,
              daily_budget: float | None) -> Cap | None:
    """What caps `batch_id`'s spend: its `options`' max_cost, and, for a batch with a row in the store (`session`),
    the budget of the day it was created on less what the key's other batches of that day spent; None when nothing
    does. The budget is its key's own (db/keys.py), else `daily_budget` (BATCH_KEY_DAILY_BUDGET); a batch with no
    row, a table batch's, has no key and no budget."""
    row = None if session is None else session.scalar(select(BatchRecord).where(BatchRecord.id == batch_id))
    budget = None
    if session is not None and row is not None:
        budget = own_daily_budget(session, row.owner, daily_budget)
    if options.max_cost is None and budget is None:
        return None
    spent = 0.0
    if session is not None and row is not None and budget is not None:
        spent = spent_on_day(session, row.owner, prices, datetime.fromtimestamp(row.created_at, UTC).date(), batch_id)
    return Cap(max_cost=options.max_cost, daily_budget=budget, spent_that_day=spent, currency=currency)


def refuse_over_cap(session: Session | None, batch_id: str, options: BatchOptions, report: ValidationReport,
                    tally: Tally | None, prices: PriceTable, daily_budget: float | None,
                    window: str | None = None) -> None:
    """At validation, an error in the valid `report` when the batch's upper-bound cost (its `tally` priced for its
    `window`, each request at its most output: the estimate's cost.max) is more than it may spend."""
    if not report.valid or report.model is None:
        return
    cap = batch_cap(session, batch_id, options, prices, prices.for_model(report.model).currency, daily_budget)
    if cap is None:
        return
    if tally is None:  # its tokenizer failed (count_tokens logged why): no cap is checked by guessing
        raise RuntimeError(f"The batch has a cost cap, and its tokens could not be counted with {report.model}'s "
                           "tokenizer; see the warning above.")
    error = cap.refusal(tally.cost(report.model, prices, window)["max"])
    if error is not None:
        report.errors.append(error)
        report.error_count += 1


def cap_reached(session: Session | None, batch_id: str, options: BatchOptions, model: str,
                committed: Iterable[CommittedShard], prices: PriceTable, daily_budget: float | None,
                window: str | None = None) -> bool:
    """While it runs, before a shard: whether the batch, having spent what its `committed` shards cost (priced for
    its `window`), must run no other shard."""
    cap = batch_cap(session, batch_id, options, prices, prices.for_model(model).currency, daily_budget)
    if cap is None:
        return False
    return cap.reached(cost_of(spent(committed), model, prices, window).total_cost)


def spent(committed: Iterable[CommittedShard]) -> Usage:
    """The usage of a batch's committed shards, together."""
    usage = Usage()
    for shard in committed:
        usage += shard.usage
    return usage


class CostCap(ShardFeature):
    """A running batch stops before the shard after it reaches its cap; with a store, what it has spent is recorded
    after each shard, where other batches' caps read it (db/lifecycle.py record_usage)."""

    def __init__(self, session: Session | None, batch_id: str, options: BatchOptions, model: str, prices: PriceTable,
                 daily_budget: float | None, window: str | None):
        self.session, self.batch_id, self.options, self.model = session, batch_id, options, model
        self.prices, self.daily_budget, self.window = prices, daily_budget, window

    def before(self, done: Mapping[int, CommittedShard]) -> str | None:
        reached = cap_reached(self.session, self.batch_id, self.options, self.model, done.values(), self.prices,
                              self.daily_budget, self.window)
        if self.session is not None:
            self.session.commit()  # the store's transaction ends here: none is held while a shard runs
        return COST_LIMIT if reached else None

    def after(self, shard: Shard, done: Mapping[int, CommittedShard]) -> None:
        if self.session is not None:
            record_usage(self.session, self.batch_id, spent(done.values()))
