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
from batch_dagster.batchfile.usage import Usage
from batch_dagster.db.models import BatchRecord
from batch_dagster.db.session import open_database
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
