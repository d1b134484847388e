"""History retention under the real Dagster daemon: on a short BATCH_HISTORY_RETENTION_S, an ended API batch's runs
and partition are deleted by `history_retention_sensor` as the daemon ticks it, and what the API serves is kept."""

from __future__ import annotations

import time

import dagster as dg

from tests.helpers import Serve, chat_request

PARTITIONS = "batches"


def test_the_daemon_deletes_an_ended_batchs_runs_and_partition_once_past_retention(tmp_path):
    env = {"module": "tests.daemon_defs", "BATCH_TEST_CALLS": str(tmp_path / "calls.jsonl"),
           "BATCH_HISTORY_RETENTION_S": "1"}
    with Serve(tmp_path, **env) as serve:
        batch = serve.create_batch([chat_request(f"r{i}", f"question {i}", max_tokens=4) for i in range(3)])
        done = serve.wait_for(batch.id, {"completed", "failed"}, 120)
        assert done.status == "completed"
        folder = serve.data_dir / "batches" / batch.id
        with serve.instance() as instance:
            runs = dg.RunsFilter(tags={"dagster/partition": batch.id})
            assert instance.get_runs(runs) and batch.id in instance.get_dynamic_partitions(PARTITIONS)
            # The sensor ticks once a minute: within two ticks the ended batch is past its 1 s of retention.
            deadline = time.time() + 150
            while instance.get_runs(runs) or batch.id in instance.get_dynamic_partitions(PARTITIONS):
                assert time.time() < deadline, f"{batch.id}'s history is still there\n{serve.logs()}"
                time.sleep(1)
            assert instance.get_runs(runs) == [] and batch.id not in instance.get_dynamic_partitions(PARTITIONS)
        # Kept: the batch (the API answers for it), its summary.json and the files the store still serves.
        client = serve.client()
        kept = client.batches.retrieve(batch.id)
        assert kept.status == "completed" and kept.request_counts.completed == 3
        assert len(client.files.content(kept.output_file_id).text.splitlines()) == 3
        assert (folder / "summary.json").exists() and not (folder / "validation.json").exists()
        assert not (folder / "results").exists()
