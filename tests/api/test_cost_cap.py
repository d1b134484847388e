"""The cost cap through the openai SDK (extra_body's `max_cost`, the operator's BATCH_KEY_DAILY_BUDGET), on the fake
engine: a batch whose upper-bound cost is past its cap fails validation; a running one whose key's budget is used up
stops before its next shard, its requests not run as error lines. Tokens are counted by a word tokenizer, as the
fake engine counts."""

from __future__ import annotations

import time

import openai
import pytest
from sqlalchemy import select

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.usage import Price, PriceTable, Usage
from batch_dagster.db.models import BatchRecord
from batch_dagster.db.session import open_database
from batch_dagster.features.cost_cap import Cap
from batch_dagster.features.estimate import Tally
from tests.api.test_estimate import estimate
from tests.helpers import CHAT_MODEL, KEY_B, rows, upload, wait_for

CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}



def lines(client: openai.OpenAI, file_id: str | None) -> list[str]:
    return client.files.content(file_id).text.splitlines() if file_id else []


def test_max_cost_is_bounded_kept_on_the_batch_and_an_upper_bound_past_it_fails_validation(start_service, tmp_path):
    service = start_service(shard_size=2)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(4, max_tokens=20))
    bound = estimate(client, file_id)["cost"]["max"]
    assert bound > 0

    def create(**extra):
        return client.batches.create(input_file_id=file_id, **CREATE, extra_body=extra)

    for bad in (0, -1, 2e9, "1", True):
        with pytest.raises(openai.BadRequestError) as refused:
            create(max_cost=bad)
        assert refused.value.code == "invalid_request" and refused.value.param == "max_cost", refused.value

    assert create().model_extra["max_cost"] is None
    tight = create(max_cost=bound * 0.99)
    assert tight.model_extra["max_cost"] == bound * 0.99
    failed = wait_for(client, tight.id, "failed")
    assert [e.code for e in failed.errors.data] == [c.COST_LIMIT_EXCEEDED], failed.errors
    assert f"{bound:g}" in failed.errors.data[0].message
    assert failed.request_counts.total == 0 and failed.output_file_id is None  # nothing ran, nothing billed

    enough = wait_for(client, create(max_cost=bound).id, "completed")  # the bound itself is allowed
    assert enough.model_extra["max_cost"] == bound and enough.request_counts.completed == 4


def test_a_running_batch_stops_when_its_keys_daily_budget_is_used_up(start_service, tmp_path):
    service = start_service(shard_size=2, key_daily_budget=1e-3)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(6, max_tokens=5))
    assert estimate(client, file_id)["cost"]["max"] < 1e-3  # each batch alone fits the budget
    batch = client.batches.create(input_file_id=file_id, **CREATE, extra_body={"max_cost": 1.0})

    def concurrent_spend(call: int) -> None:
        """While the second shard runs, another batch of the same key ends having spent past the budget."""
        if call != 2:
            return
        with open_database(service.config.database_url).session() as session:
            owner = session.scalar(select(BatchRecord.owner).where(BatchRecord.id == batch.id))
            session.add(BatchRecord(id="batch_concurrent", owner=owner, endpoint=c.CHAT, input_file_id="file-x",
                                    completion_window="24h", status="completed", created_at=int(time.time()),
                                    model=CHAT_MODEL, usage=Usage(input_tokens=100_000).to_dict()))
            session.commit()

    service.engine.on_call = concurrent_spend
    stopped = wait_for(client, batch.id, "failed")
    assert len(service.engine.calls) == 2  # the third shard never ran
    assert [e.code for e in stopped.errors.data] == [c.COST_LIMIT_EXCEEDED], stopped.errors
    assert stopped.request_counts.model_dump() == {"total": 6, "completed": 4, "failed": 2}
    errors = lines(client, stopped.error_file_id)
    assert len(lines(client, stopped.output_file_id)) == 4 and len(errors) == 2  # every request in one file
    assert all(f'"code":"{c.COST_LIMIT_EXCEEDED}"' in e.replace(" ", "") for e in errors), errors
    assert stopped.usage.output_tokens > 0  # the four that ran are billed, and only they

    # A retry keeps max_cost, and the key's budget still refuses it today.
    child = client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch)
    assert child.model_extra["max_cost"] == 1.0
    refused = wait_for(client, child.id, "failed")
    assert [e.code for e in refused.errors.data] == [c.COST_LIMIT_EXCEEDED]
    # Another key's budget is its own.
    other = service.client(KEY_B)
    other_file = upload(other, tmp_path / "b.jsonl", rows(6, max_tokens=5))
    done = wait_for(other, other.batches.create(input_file_id=other_file, **CREATE).id, "completed")
    assert done.request_counts.completed == 6


def test_nothing_caps_a_batch_without_max_cost_or_budget():
    cap = Cap()
    assert cap.allowance() is None and cap.refusal(1e9) is None and not cap.reached(1e9)

@pytest.mark.parametrize(("cap", "left"), [
    (Cap(max_cost=2.0), 2.0),
    (Cap(daily_budget=5.0, spent_that_day=4.0), 1.0),
    (Cap(max_cost=2.0, daily_budget=5.0, spent_that_day=4.0), 1.0),  # the tighter of the two
    (Cap(max_cost=0.5, daily_budget=5.0, spent_that_day=4.0), 0.5),
    (Cap(daily_budget=5.0, spent_that_day=6.0), -1.0),  # concurrent batches spent past it
])
def test_a_batch_may_spend_the_least_of_its_max_cost_and_its_keys_budget_left(cap, left):
    assert cap.allowance() == pytest.approx(left)
    assert cap.allowance(0.25) == pytest.approx(left - 0.25)

def test_validation_refuses_an_upper_bound_past_the_allowance_only():
    cap = Cap(max_cost=1.0, daily_budget=10.0, spent_that_day=8.5, currency="EUR")
    assert cap.refusal(1.0) is None and cap.refusal(0.3) is None
    error = cap.refusal(1.00001)
    assert error is not None and error.code == c.COST_LIMIT_EXCEEDED == "cost_limit_exceeded"
    assert "1.00001 EUR" in error.message and "max_cost 1" in error.message and "8.5 is spent" in error.message
    tight = Cap(daily_budget=10.0, spent_that_day=9.5)
    assert tight.refusal(0.5) is None and tight.refusal(0.6) is not None
    assert "0.5 it may spend" in tight.refusal(0.6).message  # type: ignore[union-attr]

def test_a_running_batch_stops_once_its_spend_reaches_the_cap():
    assert not Cap(max_cost=1.0).reached(0.99999)
    assert Cap(max_cost=1.0).reached(1.0) and Cap(max_cost=1.0).reached(1.5)
    budget = Cap(daily_budget=1.0, spent_that_day=0.7)
    assert not budget.reached(0.2) and budget.reached(0.3) and budget.reached(0.3 - 1e-9)  # rounded costs
    assert Cap(daily_budget=1.0, spent_that_day=1.0).reached(0.0)  # used up by the key's other batches

def test_the_upper_bound_is_the_estimates_cost_max():
    prices = PriceTable({"m": Price(input_per_1m=1.0, output_per_1m=4.0, batch_discount=0.5, currency="EUR")})
    tally = Tally(requests=2, input_tokens=1_000_000, max_output_tokens=500_000)
    assert tally.cost("m", prices) == {"min": 0.5, "max": 0.5 + 1.0, "currency": "EUR"}
    assert tally.cost("unpriced", prices)["max"] == 0.0  # the default price: nothing to cap


def test_batches_that_straddle_midnight_keep_the_budget_of_the_day_they_were_created(tmp_path):
    """Five batches created at 23:59 have spent 0.9 each of a 1.0 budget: they stay stopped after midnight (the
    check asks their own day, whenever it runs), and a batch created at 00:01 is charged nothing of theirs."""
    from datetime import UTC, datetime

    from batch_dagster.db import Database, repo
    from batch_dagster.db.batches import add_input_file
    from batch_dagster.features.cost_cap import cap_reached

    prices = PriceTable({CHAT_MODEL: Price(input_per_1m=1.0, output_per_1m=1.0, batch_discount=0.0)})
    store = Database(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    before = int(datetime(2026, 3, 2, 23, 59, tzinfo=UTC).timestamp())
    after = int(datetime(2026, 3, 3, 0, 1, tzinfo=UTC).timestamp())
    with store.session() as session:
        add_input_file(session, owner="o", file_id="file-in", filename="in.jsonl", size=1)
        for i in range(5):  # 0.9 each: 900,000 tokens at 1.0 a million
            session.add(BatchRecord(id=f"batch_late{i}", owner="o", endpoint=c.CHAT, input_file_id="file-in",
                                    completion_window="24h", status="in_progress", created_at=before, model=CHAT_MODEL,
                                    usage=Usage(input_tokens=900_000).to_dict()))
        session.add(BatchRecord(id="batch_new", owner="o", endpoint=c.CHAT, input_file_id="file-in",
                                completion_window="24h", status="in_progress", created_at=after, model=CHAT_MODEL))
        session.commit()
        # Each late batch's own 0.9 plus its siblings' 3.6: past its day's 1.0, before and after midnight alike.
        assert cap_reached(session, "batch_late0", CHAT_MODEL, [], prices, daily_budget=1.0)
        # The new day's batch: its day's budget is whole, whatever yesterday's batches spend today.
        assert not cap_reached(session, "batch_new", CHAT_MODEL, [], prices, daily_budget=1.0)
        assert repo.get_batch(session, "o", "batch_new") is not None
    store.dispose()
