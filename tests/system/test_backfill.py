"""Backfills of finished batches, launched as the Dagster UI launches them, under the real daemon.

Both kinds the UI offers: the job's partitions page ("Launch backfill" of batch_job) and the asset graph
("Materialize" the lifecycle assets for chosen partitions). A backfill re-runs every asset of a batch:
no shard is recomputed, the output and error files are rewritten whole, and the counts stay the same.
"""

from __future__ import annotations

import time

import dagster as dg
import httpx

from batch_dagster.defs.assets.batch import LIFECYCLE
from batch_dagster.defs.resources import StorageResource
from tests.daemon_defs import engine_calls
from tests.helpers import (
    Serve,
    batch_runs,
    chat_request,
    committed_files,
    file_stats,
    local_file,
    materialization_metadata,
    read_jsonl,
)

LAUNCH_BACKFILL = """
mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
  }
}
"""
REPOSITORY = {"repositoryLocationName": "tests", "repositoryName": "__repository__"}


def launch_backfill(serve: Serve, params: dict) -> str:
    response = httpx.post(f"{serve.ui_url}/graphql", json={"query": LAUNCH_BACKFILL, "variables": {"params": params}},
                          timeout=60)
    result = response.json()["data"]["launchPartitionBackfill"]
    assert result["__typename"] == "LaunchBackfillSuccess", result
    return result["backfillId"]


def wait_for_backfill(instance: dg.DagsterInstance, backfill_id: str, partitions: int, timeout_s: float = 120):
    """The backfill's runs, once the daemon has launched one per partition and all have finished."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        if len(runs) == partitions and all(r.is_finished for r in runs):
            return runs
        time.sleep(0.5)
    raise TimeoutError(f"backfill {backfill_id}: {instance.get_backfill(backfill_id)}")


def snapshot(storage: StorageResource, batch_id: str) -> dict:
    """What a re-run must keep: shard files untouched, merged files' content, the summary's counts."""
    folder = storage.folder(batch_id)
    summary = folder.summary()
    assert summary is not None
    return {
        "shards": file_stats(committed_files(local_file(folder, folder.results_prefix))),
        "output": local_file(folder, folder.output_key).read_bytes(),
        "errors": local_file(folder, folder.error_key).read_bytes(),
        "counts": (summary.request_counts, summary.usage, summary.cost),
    }


def merged_inodes(storage: StorageResource, batch_id: str) -> tuple[int, int]:
    folder = storage.folder(batch_id)
    return local_file(folder, folder.output_key).stat().st_ino, local_file(folder, folder.error_key).stat().st_ino


def test_backfills_of_finished_batches_redo_no_shard_and_rewrite_files_whole(tmp_path):
    calls = tmp_path / "calls.jsonl"
    inputs = {
        "a": [chat_request(f"a{i}", f"question {i} " + "word " * i, max_tokens=4) for i in range(5)]
        + [chat_request("a-bad", "hi", temperature=-1)],
        "b": [chat_request(f"b{i}", f"another question {i}", max_tokens=4) for i in range(4)],
    }
    with Serve(tmp_path, module="tests.daemon_defs", ui=True, BATCH_SHARD_SIZE="2",
               BATCH_TEST_CALLS=str(calls)) as serve:
        batches = {name: serve.create_batch(rows, f"{name}.jsonl") for name, rows in inputs.items()}
        ids = [b.id for b in batches.values()]
        first = {b.id: serve.wait_for(b.id, {"completed", "failed"}, 120) for b in batches.values()}
        storage = StorageResource(data_dir=str(serve.data_dir))
        with serve.instance() as instance:
            for batch_id in ids:
                batch_runs(instance, batch_id)
            before = {batch_id: snapshot(storage, batch_id) for batch_id in ids}
            engine_before = engine_calls(calls)

            launched = {
                # Jobs > batch_job > Partitions > select both > Launch backfill.
                "job": {"selector": {"partitionSetName": "batch_job_partition_set", "repositorySelector": REPOSITORY},
                        "partitionNames": ids},
                # Asset graph > select the lifecycle assets > Materialize > choose both partitions.
                "assets": {"assetSelection": [{"path": [key.path[-1]]} for key in LIFECYCLE],
                           "partitionNames": ids},
            }
            for kind, params in launched.items():
                inodes = {batch_id: merged_inodes(storage, batch_id) for batch_id in ids}
                backfill_id = launch_backfill(serve, params)
                runs = wait_for_backfill(instance, backfill_id, len(ids))

                assert sorted(r.tags["dagster/partition"] for r in runs) == sorted(ids), kind
                assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs), kind
                for run in runs:
                    shard_results = materialization_metadata(instance, run.run_id, "shard_results")
                    assert shard_results["shards_run"] == 0 and shard_results["status"] == "cached", kind
                # No engine call, no shard file touched; output and error files replaced whole, same lines.
                assert engine_calls(calls) == engine_before, kind
                for batch_id in ids:
                    assert snapshot(storage, batch_id) == before[batch_id], (kind, batch_id)
                    new_inodes = merged_inodes(storage, batch_id)
                    assert all(new != old for new, old in zip(new_inodes, inodes[batch_id])), (kind, batch_id)

        client = serve.client()
        after = {batch_id: client.batches.retrieve(batch_id) for batch_id in ids}
        sizes = {batch_id: client.files.retrieve(after[batch_id].output_file_id).bytes for batch_id in ids}

    for name, batch in batches.items():
        folder = storage.folder(batch.id)
        out, err = read_jsonl(local_file(folder, folder.output_key)), read_jsonl(local_file(folder, folder.error_key))
        assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in inputs[name])
        # The API's batch is the same finished batch: same counts (not doubled), same files.
        assert after[batch.id].model_dump() == first[batch.id].model_dump()
        assert sizes[batch.id] == local_file(folder, folder.output_key).stat().st_size
    assert first[batches["a"].id].request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}
    assert len(engine_calls(calls)) == 3 + 2  # a: 6 requests in shards of 2; b: 4
