"""/v1/responses batches through the pipeline on the fake engine."""

from __future__ import annotations

import dagster as dg

from batch_dagster.batchfile import contract as c
from batch_dagster.defs.runner import run_batch
from tests.helpers import CHAT_MODEL, FakeEngine, fake_vllm, make_defs, read_jsonl, write_jsonl


def responses_request(cid: str, text: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": c.RESPONSES, "body": {"model": CHAT_MODEL, "input": text, **body}}


def test_responses_batch_writes_response_objects_and_counts_their_usage(tmp_path, data_dir, instance):
    defs = make_defs(data_dir, fake_vllm("responses", FakeEngine()), shard_size=2)
    rows = [responses_request(f"r{i}", f"say {i} " + "x " * i, instructions="Be brief.", max_output_tokens=4)
            for i in range(5)] + [responses_request("cold", "hi", temperature=-1)]
    # temperature -1 is reported by validation at its line and param; the request ends as its own 400 line.
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
    [refused] = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert refused["custom_id"] == "cold" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    out = read_jsonl(tmp_path / "out" / "output.jsonl")
    bodies = [line["response"]["body"] for line in out]
    assert {b["object"] for b in bodies} == {"response"} and {b["status"] for b in bodies} == {"completed"}
    assert all(b["output"][0]["content"][0]["type"] == "output_text" for b in bodies)
    assert summary["usage"]["input_tokens"] == sum(b["usage"]["input_tokens"] for b in bodies) > 0
    assert summary["usage"]["output_tokens"] == sum(b["usage"]["output_tokens"] for b in bodies) > 0
    check = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("batch_usage"), "usage_equals_output_lines"), limit=1)
    assert check and check[0].status.value == "SUCCEEDED"
