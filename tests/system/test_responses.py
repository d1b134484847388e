"""/v1/responses batches on the real engine: uploaded with the openai SDK, offline and through a vLLM server."""

from __future__ import annotations

import json

import pytest

from batch_dagster.batchfile import contract as c
from tests.api.conftest import start_service  # noqa: F401 - the in-process API, here with the real engine
from tests.helpers import CHAT_MODEL, real_vllm, run_on_real_engine, upload, wait_for

pytestmark = pytest.mark.engine


def request(cid: str, text: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": c.RESPONSES, "body": {"model": CHAT_MODEL, "input": text, **body}}


ROWS = [
    request("capital", "What is the capital of France?", instructions="Answer in one short sentence.",
            max_output_tokens=16, temperature=0),
    request("items", [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
            max_output_tokens=24, temperature=0),
    request("too-long", "word " * 2500, max_output_tokens=16),
]


def test_responses_batch_through_the_api_on_the_real_engine(start_service, tmp_path):  # noqa: F811
    service = start_service(vllm=real_vllm(), shard_size=10)
    client = service.client()
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", ROWS), endpoint=c.RESPONSES,
                                  completion_window="24h")
    done = wait_for(client, batch.id, "completed", timeout_s=240)
    assert done.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    bodies = {x["custom_id"]: x["response"]["body"] for x in out}
    assert set(bodies) == {"capital", "items"}
    answer = bodies["capital"]
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
    assert answer["instructions"] == "Answer in one short sentence." and answer["model"] == CHAT_MODEL
    assert "Paris" in answer["output"][0]["content"][0]["text"]
    assert answer["usage"]["input_tokens"] > 10  # the instructions are part of the prompt
    [error] = err
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == c.CONTEXT_LENGTH_EXCEEDED
    assert error["response"]["body"]["error"]["param"] == "input_tokens"  # vLLM's, as its server answers it
    assert done.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in bodies.values())
    assert done.usage.output_tokens == sum(b["usage"]["output_tokens"] for b in bodies.values()) > 0


def shape(body: dict) -> tuple:
    """What must agree between offline and server: the object's structure and the token counts."""
    [item] = body["output"]
    return (body["object"], body["model"], body["status"], item["type"], item["role"],
            [part["type"] for part in item["content"]], body["usage"]["input_tokens"],
            sorted(body["usage"]), body["instructions"])


def test_offline_and_server_write_the_same_response_objects(tmp_path, data_dir, instance, vllm_server):
    rows = ROWS[:2]
    offline_dir, server_dir = tmp_path / "offline", tmp_path / "server"
    offline_dir.mkdir(), server_dir.mkdir()
    _, out1, _ = run_on_real_engine(offline_dir, data_dir, instance, rows)
    _, out2, _ = run_on_real_engine(server_dir, data_dir, instance, rows, mode="server", server_urls=[vllm_server])
    assert set(out1) == set(out2) == {"capital", "items"}
    for cid in out1:
        offline, server = out1[cid]["response"]["body"], out2[cid]["response"]["body"]
        assert shape(offline) == shape(server), cid
        assert offline["output"][0]["content"][0]["text"] == server["output"][0]["content"][0]["text"], cid
        assert set(offline) <= set(server), set(offline) - set(server)
