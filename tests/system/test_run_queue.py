"""The run queue under the real daemon (`make serve` with the project's dagster.yaml): batches of a model with a
fleet run side by side on it, while batches whose model runs in the run's own process wait for each other."""

from __future__ import annotations

import dagster as dg
import pytest

from tests.helpers import (
    CHAT_MODEL,
    EMBED_MODEL,
    InferenceGate,
    Serve,
    batch_runs,
    chat_request,
    step_events,
    write_jsonl,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def shard_results_span(instance: dg.DagsterInstance, run_id: str) -> tuple[float, float]:
    """When the run's inference step started and succeeded."""
    [start] = step_events(instance, run_id, dg.DagsterEventType.STEP_START, "shard_results")
    [end] = step_events(instance, run_id, dg.DagsterEventType.STEP_SUCCESS, "shard_results")
    return start.event_log_entry.timestamp, end.event_log_entry.timestamp


def test_fleet_batches_run_side_by_side_and_offline_batches_one_at_a_time(tmp_path, vllm_server):
    # CHAT_MODEL's fleet is the session's real vLLM server, behind a gate that holds its requests until both fleet
    # batches have sent one (their prompts say "story" and "tale"): batches the queue lets run side by side then do,
    # however fast the CPU ends the first (at 6,144 tokens a batch, one did before the daemon launched the other).
    # EMBED_MODEL has none: its batches run in the run's process, here on the fake engine of tests.daemon_defs (4 s a
    # call), since what is under test is the queue.
    chat = [[chat_request(f"c{i:02d}", f"Tell a {word} about the number {i}.", max_tokens=16, temperature=0)
             for i in range(32)] for word in ("story", "tale")]
    embed = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": EMBED_MODEL, "input": f"sentence number {i}"}} for i in range(4)]
    with InferenceGate(vllm_server, ("story", "tale")) as gate, \
            Serve(tmp_path, module="tests.daemon_defs", BATCH_FLEET_URLS=f"{CHAT_MODEL}={gate.url}",
                  BATCH_SHARD_SIZE="8", BATCH_TEST_CALLS=str(tmp_path / "calls.jsonl"), BATCH_TEST_CALL_S="4") as serve:
        client = serve.client()

        def create(rows: list[dict], name: str, endpoint: str):
            with open(write_jsonl(tmp_path / name, rows), "rb") as f:
                file_id = client.files.create(file=f, purpose="batch").id
            return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")

        fleet = [create(rows, f"fleet-{i}.jsonl", "/v1/chat/completions") for i, rows in enumerate(chat)]
        offline = [create(embed, f"offline-{i}.jsonl", "/v1/embeddings") for i in range(2)]
        done = [serve.wait_for(b.id, {"completed", "failed"}, 300) for b in fleet + offline]
        with serve.instance() as instance:
            runs = {b.id: batch_runs(instance, b.id) for b in fleet + offline}
            spans = {batch_id: shard_results_span(instance, r.run_id) for batch_id, [r] in runs.items()}
            records = {batch_id: instance.get_run_record_by_id(r.run_id) for batch_id, [r] in runs.items()}

    assert [b.status for b in done] == ["completed"] * 4, serve.logs()
    assert [b.request_counts.completed for b in done] == [32, 32, 4, 4]
    queue_tags = {batch_id: {k: v for k, v in r.tags.items() if k.startswith("batch/")}
                  for batch_id, [r] in runs.items()}
    assert [queue_tags[b.id] for b in fleet] == [{"batch/engine": "server", "batch/model": CHAT_MODEL}] * 2
    assert [queue_tags[b.id] for b in offline] == [{"batch/engine": "offline", "batch/model": EMBED_MODEL}] * 2

    # The fleet's two batches were inferred at the same time: each sent a request before the other's were answered.
    assert gate.opened_at is not None, "the fleet's batches did not run side by side"
    (start_a, end_a), (start_b, end_b) = (spans[b.id] for b in fleet)
    assert start_a < end_b and start_b < end_a, spans
    # The offline batches were not: the second run was launched only once the first had ended.
    first, second = sorted((records[b.id] for b in offline), key=lambda r: r.start_time or 0)
    assert first.end_time is not None and second.start_time is not None and second.start_time >= first.end_time
    (_, end_c), (start_d, _) = sorted(spans[b.id] for b in offline)
    assert end_c <= start_d, spans
