"""Queue position, ETA and priority under serve on the real engine, through the openai SDK: with one run of the model
at a time (BATCH_RUNS_PER_MODEL=1), while a first batch runs at queue_position 0, an urgent batch (priority 5)
submitted after a normal one waits at 1 and the normal one at 2, each with a plausible estimated_completion_at in
that order; the urgent one starts next; all null once ended; a waiting run is tagged with its place; the validated
batch carries the estimate POST /estimate answered, its input_tokens the engine's."""

from __future__ import annotations

import time

import dagster as dg
import pytest
from openai import OpenAI

from batch_dagster.defs.eta import ETA_TAG, POSITION_TAG
from tests.helpers import SERVE_API_KEY, InferenceGate, Serve, chat_request, write_jsonl

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_a_batch_waits_in_place_and_both_end_near_their_eta(tmp_path, vllm_server):
    # The server sits behind a gate that holds the first batch's requests until the test has seen the others wait
    # in place (at first the first batch decoded 12 x 32 tokens, and ended within a tick of the ETA sensor on a fast
    # CPU); the gate's timeout lets them through if that never comes, and the assertions say what was seen.
    gate = InferenceGate(vllm_server, timeout_s=300)
    serve = Serve(tmp_path, BATCH_ENGINE_MODE="server", BATCH_VLLM_SERVER_URLS=gate.url, BATCH_SHARD_SIZE="2",
                  BATCH_RUNS_PER_MODEL="1", BATCH_KEY_MAX_PRIORITY="5")
    with gate, serve:
        client = OpenAI(base_url=f"http://127.0.0.1:{serve.api_port}/v1", api_key=SERVE_API_KEY, max_retries=0,
                        timeout=30)

        def upload(name: str, n: int, tokens: int = 32) -> str:
            rows = [chat_request(f"{name}{i}", f"Write a short story about the number {i}.", max_tokens=tokens,
                                 min_tokens=tokens, temperature=0) for i in range(n)]
            with open(write_jsonl(tmp_path / f"{name}.jsonl", rows), "rb") as f:
                return client.files.create(file=f, purpose="batch").id

        def create(file_id: str, priority: int = 0):
            return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h", extra_body={"priority": priority})

        first_file, second_file, urgent_file = upload("a", 12), upload("b", 3), upload("c", 3)
        # The first estimate of a model loads its tokenizer in the API (transformers and torch): past 30 s here.
        expected = client.post("/batches/estimate", cast_to=object, options={"timeout": 300}, body={
            "input_file_id": second_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        first, second = create(first_file), create(second_file)
        seen, tags = [], {}
        deadline = time.time() + 600
        # The urgent batch comes once the first runs (sent at once, it would start first of all).
        while (first := client.batches.retrieve(first.id)).status == "validating":
            assert time.time() < deadline and serve.proc.poll() is None, serve.logs()
            time.sleep(0.3)
        urgent = create(urgent_file, priority=5)

        def read_all():
            """The three batches from one list call, one read of the store: their places and ends are those of one
            tick of the ETA sensor (retrieved one by one, a tick between the reads paired the running batch's end from
            before it with the urgent one's from after it, when both had moved earlier)."""
            batches = {b.id: b for b in client.batches.list(limit=10)}
            return batches[first.id], batches[urgent.id], batches[second.id]

        while (batches := read_all())[2].status not in ("completed", "failed"):
            assert time.time() < deadline and serve.proc.poll() is None, serve.logs()
            first, urgent, second = batches
            seen.append((time.time(), first.status, first.queue_position, urgent.queue_position, second.status,
                         second.queue_position, first.estimated_completion_at, urgent.estimated_completion_at,
                         second.estimated_completion_at))
            if second.queue_position == 1 and POSITION_TAG not in tags:  # its queued run's tags show it too
                with serve.instance() as instance:
                    runs = instance.get_runs(dg.RunsFilter(job_name="batch_job",
                                                           tags={"dagster/partition": second.id}), limit=1)
                    tags = dict(runs[0].tags) if runs else {}
            if seen[-1][1:6] == ("in_progress", 0, 1, "validating", 2):
                gate.open()  # each is in place: the first batch may run
            time.sleep(0.3)
        first, urgent, second = batches

    # While the first ran, the urgent batch waited first in line and the normal one behind it, each with an end in
    # the future, in that order.
    waiting = [s for s in seen if s[1] == "in_progress" and s[2] == 0 and s[3] == 1 and s[4] == "validating"
               and s[5] == 2]
    assert waiting, [s[1:6] for i, s in enumerate(seen) if i == 0 or s[1:6] != seen[i - 1][1:6]]  # each state once
    at, *_, first_eta, urgent_eta, second_eta = waiting[-1]
    assert tags[POSITION_TAG] == "1" and ETA_TAG in tags, tags
    assert at - 5 <= first_eta <= urgent_eta <= second_eta <= at + 3600, waiting[-1]
    # The urgent batch, submitted last, ran before the normal one (the next to start).
    assert urgent.in_progress_at is not None and second.in_progress_at is not None
    assert urgent.in_progress_at <= second.in_progress_at, (urgent, second)
    assert urgent.completed_at is not None and second.completed_at is not None
    assert urgent.completed_at <= second.completed_at
    # Once ended: no place, no end; the estimate is the one POST /estimate made, in the engine's own tokens.
    for batch in (first, urgent, second):
        assert batch.status == "completed", serve.logs()
        assert batch.queue_position is None and batch.estimated_completion_at is None
    assert second.estimate["input_tokens"] == expected["input_tokens"] == second.usage.input_tokens
    assert second.estimate["max_output_tokens"] == expected["max_output_tokens"] == 3 * 32
    assert first.estimate["total_requests"] == 12
