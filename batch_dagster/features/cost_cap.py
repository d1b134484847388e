"""A batch's cost cap: what it may spend (its `max_cost`; its key's daily budget less what the key's other batches
of the day spent), the refusal at validation, and the stop while it runs.

Costs are those of usage.py (successful requests only, at the batch price). docs/http-api.md ("Cost cap") says
what each check compares.
"""

from __future__ import annotations

from dataclasses import dataclass

from batch_dagster.batchfile import contract as c

# Costs are rounded to 8 decimals (usage.Cost): a sum within this of the cap has reached it.
_EPSILON = 1e-8


@dataclass(frozen=True)
class Cap:
    """What bounds one batch's spend; None: that bound is not set."""

    max_cost: float | None = None
    daily_budget: float | None = None
    spent_today: float = 0.0  # by the key's other batches created this UTC day
    currency: str = "USD"

    def allowance(self, spent: float = 0.0) -> float | None:
        """What the batch may still spend once it has spent `spent`; None: nothing caps it."""
        left = []
        if self.max_cost is not None:
            left.append(self.max_cost - spent)
        if self.daily_budget is not None:
            left.append(self.daily_budget - self.spent_today - spent)
        return min(left) if left else None

    def _limits(self) -> str:
        parts = []
        if self.max_cost is not None:
            parts.append(f"max_cost {self.max_cost:g}")
        if self.daily_budget is not None:
            parts.append(f"the key's daily budget {self.daily_budget:g}, of which {self.spent_today:g} is spent "
                         "today by its other batches")
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

