"""Queue position and ETA through the openai SDK (extra fields of its Batch): the place among the model's batches
while queued, 0 while running, null once ended; the estimate on the validated batch, as POST /estimate answers."""

from __future__ import annotations

import time

from tests.api.test_estimate import estimate
from tests.helpers import make_defs, rows, upload, wait_for


def test_a_batch_shows_its_place_and_end_while_queued_and_running_and_its_estimate_once_validated(start_service,
                                                                                                   tmp_path):
    service = start_service(worker=False, shard_size=2, key_max_priority=5)
    # Validation estimates a batch against the API's store (its queue and rate): the pipeline is given it.
    service.worker.defs = make_defs(service.data_dir, service.worker.defs.resources["vllm"], 2,
                                    database_url=service.config.database_url)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", rows(5, max_tokens=50))
    expected = estimate(client, file_id)

    def create(**body):
        return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                     **body)

    first, urgent = create(), create(extra_body={"priority": 5})
    assert first.queue_position is None and first.estimate is None  # the daemon has not placed it yet
    service.worker.follow()  # its sensors' tick, before any launch
    queued = {b.id: client.batches.retrieve(b.id) for b in (first, urgent)}
    # The launch order: the higher priority first, though submitted later; it ends before the one behind it.
    assert [queued[b.id].queue_position for b in (urgent, first)] == [1, 2]
    ends = [queued[b.id].estimated_completion_at for b in (urgent, first)]
    assert time.time() - 5 < ends[0] <= ends[1] < time.time() + 3600

    running: dict[str, object] = {}

    def while_running(call: int) -> None:  # first's second shard: its first one committed
        if call == 2 and not running:
            service.worker.follow()
            running.update(first=client.batches.retrieve(first.id), urgent=client.batches.retrieve(urgent.id))

    service.engine.on_call = while_running
    service.start_worker()
    done = [wait_for(client, b.id, "completed") for b in (first, urgent)]
    now = client.batches.retrieve(first.id)
    mid = running["first"]
    assert mid.status == "in_progress" and mid.queue_position == 0 and mid.request_counts.completed == 2
    assert now.completed_at - 5 <= mid.estimated_completion_at <= time.time() + 3600
    assert running["urgent"].queue_position == 1  # still first of the waiting ones
    for batch in done:
        assert batch.queue_position is None and batch.estimated_completion_at is None
        assert batch.estimate["object"] == "batch.estimate" and batch.estimate["valid"]
        for name in ("input_tokens", "max_output_tokens", "total_requests", "cost"):
            assert batch.estimate[name] == expected[name]
        assert batch.estimate["input_tokens"] == batch.usage.input_tokens
