"""The cost cap's arithmetic: what a batch may spend, when validation refuses it, when a running one stops, and how a
batch its cap stopped ends."""

from __future__ import annotations

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.failure import COST_LIMIT, stopped_ending
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.usage import Price, PriceTable
from batch_dagster.features.cost_cap import Cap
from batch_dagster.features.estimate import Tally
from batch_dagster.features.retry import is_retryable


def test_nothing_caps_a_batch_without_max_cost_or_budget():
    cap = Cap()
    assert cap.allowance() is None and cap.refusal(1e9) is None and not cap.reached(1e9)


@pytest.mark.parametrize(("cap", "left"), [
    (Cap(max_cost=2.0), 2.0),
    (Cap(daily_budget=5.0, spent_today=4.0), 1.0),
    (Cap(max_cost=2.0, daily_budget=5.0, spent_today=4.0), 1.0),  # the tighter of the two
    (Cap(max_cost=0.5, daily_budget=5.0, spent_today=4.0), 0.5),
    (Cap(daily_budget=5.0, spent_today=6.0), -1.0),  # concurrent batches spent past it
])
def test_a_batch_may_spend_the_least_of_its_max_cost_and_its_keys_budget_left(cap, left):
    assert cap.allowance() == pytest.approx(left)
    assert cap.allowance(0.25) == pytest.approx(left - 0.25)


def test_validation_refuses_an_upper_bound_past_the_allowance_only():
    cap = Cap(max_cost=1.0, daily_budget=10.0, spent_today=8.5, currency="EUR")
    assert cap.refusal(1.0) is None and cap.refusal(0.3) is None
    error = cap.refusal(1.00001)
    assert error is not None and error.code == c.COST_LIMIT_EXCEEDED == "cost_limit_exceeded"
    assert "1.00001 EUR" in error.message and "max_cost 1" in error.message and "8.5 is spent" in error.message
    tight = Cap(daily_budget=10.0, spent_today=9.5)
    assert tight.refusal(0.5) is None and tight.refusal(0.6) is not None
    assert "0.5 it may spend" in tight.refusal(0.6).message  # type: ignore[union-attr]


def test_a_running_batch_stops_once_its_spend_reaches_the_cap():
    assert not Cap(max_cost=1.0).reached(0.99999)
    assert Cap(max_cost=1.0).reached(1.0) and Cap(max_cost=1.0).reached(1.5)
    budget = Cap(daily_budget=1.0, spent_today=0.7)
    assert not budget.reached(0.2) and budget.reached(0.3) and budget.reached(0.3 - 1e-9)  # rounded costs
    assert Cap(daily_budget=1.0, spent_today=1.0).reached(0.0)  # used up by the key's other batches


def test_the_upper_bound_is_the_estimates_cost_max():
    prices = PriceTable({"m": Price(input_per_1m=1.0, output_per_1m=4.0, batch_discount=0.5, currency="EUR")})
    tally = Tally(requests=2, input_tokens=1_000_000, max_output_tokens=500_000)
    assert tally.cost("m", prices) == {"min": 0.5, "max": 0.5 + 1.0, "currency": "EUR"}
    assert tally.cost("unpriced", prices)["max"] == 0.0  # the default price: nothing to cap


def test_a_batch_its_cap_stopped_fails_with_its_code_and_its_requests_are_retryable():
    ending = stopped_ending(COST_LIMIT)
    assert ending.status == BatchStatus.FAILED and ending.code == c.COST_LIMIT_EXCEEDED
    assert [e.code for e in ending.errors] == [c.COST_LIMIT_EXCEEDED]
    line = c.not_run_line("a", ending.code, ending.message)
    assert is_retryable(line)  # not the request's fault: a retry (with budget left) runs it
    cancelled = stopped_ending(BatchStatus.CANCELLED)
    assert (cancelled.status, cancelled.code, cancelled.errors) == (BatchStatus.CANCELLED, c.BATCH_CANCELLED, [])
    assert stopped_ending(BatchStatus.EXPIRED).code == c.BATCH_EXPIRED
