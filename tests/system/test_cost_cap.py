"""The cost cap under `serve` on the real engine, through the openai SDK: a batch whose max_cost is below its
upper-bound cost fails validation; two batches of one key, each within BATCH_KEY_DAILY_BUDGET but not together,
run side by side on the session's vLLM server (the chat model's fleet, behind a gate that holds its requests until
both have sent one) until the key's spend reaches the budget,
and the one that would go past it stops before its next shard, its requests not run as error lines."""

from __future__ import annotations

import json

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.usage import Usage, cost_of, load_price_table
from batch_dagster.engine.models import Models
from batch_dagster.features.estimate import Tally
from batch_dagster.settings import Settings
from tests.helpers import CHAT_MODEL, InferenceGate, Serve, chat_request, write_jsonl

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
REQUESTS, SHARD = 24, 2
# Exactly max_tokens out (min_tokens): each request then costs its upper bound, so the spend is known in advance.
# The two batches that run side by side ask for stories and tales: the gate in front of the fleet lets their requests
# through once it has seen both words (on a fast CPU, the first batch had ended before the second was validated,
# which then refused it whole, as it should, but ran nothing side by side).
WORDS = ("story", "tale")


def rows(word: str) -> list[dict]:
    return [chat_request(f"s{i:02d}", f"Write a long {word} about the number {i}.", max_tokens=24, min_tokens=24,
                         temperature=0) for i in range(REQUESTS)]


def upper_bound(rows: list[dict]) -> float:
    """The batch's upper-bound cost as validation counts it: the model's tokenizer, each request at max_tokens."""
    settings = Settings.from_env()
    count, context_length = Models.from_settings(settings).counter(CHAT_MODEL)
    tally = Tally()
    for row in rows:
        tally.add(c.CHAT, row["body"], count, context_length)
    return tally.cost(CHAT_MODEL, load_price_table(settings.prices_file))["max"]


def test_max_cost_fails_validation_and_the_daily_budget_stops_a_running_batch(tmp_path, vllm_server):
    bounds = [upper_bound(rows(word)) for word in WORDS]
    shard = bounds[0] * SHARD / REQUESTS  # about one shard's cost (the prompts differ by a digit or two)
    budget = sum(bounds) - 3 * shard  # each batch fits alone; together they pass it with three shards to go
    with InferenceGate(vllm_server, WORDS) as gate, \
            Serve(tmp_path, BATCH_FLEET_URLS=f"{CHAT_MODEL}={gate.url}", BATCH_SHARD_SIZE=str(SHARD),
                  BATCH_KEY_DAILY_BUDGET=repr(budget)) as serve:
        client = serve.client()
        file_ids = []
        for word in WORDS:
            with open(write_jsonl(tmp_path / f"{word}.jsonl", rows(word)), "rb") as f:
                file_ids.append(client.files.create(file=f, purpose="batch").id)
        create = [{"input_file_id": file_id, "endpoint": c.CHAT, "completion_window": "24h"} for file_id in file_ids]
        estimate = client.post("/batches/estimate", body=create[0], cast_to=object, options={"timeout": 300})
        assert estimate["cost"]["max"] == pytest.approx(bounds[0], rel=1e-9)  # the same count as validation's

        capped = client.batches.create(**create[0], extra_body={"max_cost": bounds[0] / 2})
        side_by_side = [client.batches.create(**body) for body in create]
        refused = serve.wait_for(capped.id, {"completed", "failed"}, 300)
        ended = [serve.wait_for(b.id, {"completed", "failed", "cancelled"}, 600) for b in side_by_side]
        files = {b.id: [client.files.content(f).text.splitlines() if f else [] for f in (b.output_file_id,
                                                                                        b.error_file_id)]
                 for b in ended}

    # (a) Its upper bound is twice its max_cost: refused before anything runs.
    assert refused.status == "failed", serve.logs()
    assert [e.code for e in refused.errors.data] == [c.COST_LIMIT_EXCEEDED], refused.errors
    assert refused.request_counts.total == 0 and refused.output_file_id is None

    # (b) The key's spend reached the budget while both ran: at least one stopped, having run some of its shards.
    assert gate.opened_at is not None, "the two batches did not run side by side"
    stopped = [b for b in ended if b.status == "failed"]
    assert stopped and all(b.status in ("completed", "failed") for b in ended), (ended, serve.logs())
    for b in stopped:
        assert [e.code for e in b.errors.data] == [c.COST_LIMIT_EXCEEDED], b.errors
        assert 0 < b.request_counts.completed < REQUESTS, b.request_counts
    for b in ended:
        output, errors = files[b.id]
        # Every request in one file: answered, or not run because of the cap (nothing else fails here).
        assert len(output) == b.request_counts.completed and len(output) + len(errors) == REQUESTS, b.request_counts
        assert all(json.loads(e)["error"]["code"] == c.COST_LIMIT_EXCEEDED for e in errors), errors[:2]
    # Only what ran is billed; it passes the budget by at most the shards already started when it was reached.
    billed = sum(cost_of(Usage(b.usage.input_tokens, b.usage.output_tokens), CHAT_MODEL,
                         load_price_table(Settings.from_env().prices_file)).total_cost for b in ended)
    assert budget <= billed <= budget + 2 * shard * 1.5, (billed, budget, shard)
