"""`make serve` for real: the API, dagster-webserver and dagster-daemon, a batch on the real engine, Ctrl-C.

(That serve refuses to listen beyond loopback without keys is in tests/api/test_serve.py.)"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time

import dagster as dg
import httpx
import psutil
import pytest
from openai import OpenAI

from tests.helpers import (
    CHAT_MODEL,
    CONCISE,
    REPO,
    Receiver,
    chat_request,
    free_port,
    serve_env,
    wait_http,
    write_jsonl,
)

SECRET = "whsec_" + base64.b64encode(b"a serve test secret of 32 bytes.").decode()


@pytest.mark.engine
def test_serve_runs_an_sdk_batch_on_the_real_engine_and_stops_cleanly(tmp_path, vllm_server, monkeypatch):
    api_port, ui_port = free_port(), free_port()
    receiver = Receiver()  # the operator's global webhook endpoint
    env = serve_env(tmp_path, BATCH_API_KEYS="sk-serve", BATCH_ENGINE_MODE="server",
                    BATCH_VLLM_SERVER_URLS=vllm_server, BATCH_SHARD_SIZE="2", BATCH_WEBHOOK_URLS=receiver.url,
                    BATCH_WEBHOOK_SECRET=SECRET)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "batch_dagster.serve", "--port", str(api_port), "--dagster-port",
                             str(ui_port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{api_port}/health", 60, proc)
        wait_http(f"http://127.0.0.1:{ui_port}/server_info", 90, proc)

        # An existing openai-SDK batch script, unchanged but for base_url and api_key.
        client = OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="sk-serve")
        requests = [chat_request("capital", "What is the capital of France?", system=CONCISE, max_tokens=16,
                                 temperature=0),
                    chat_request("colors", "Name three colors.", max_tokens=16, temperature=0),
                    chat_request("count", "Count from one to five.", max_tokens=24, temperature=0),
                    chat_request("too-long", "word " * 2500, max_tokens=16)]
        with open(write_jsonl(tmp_path / "requests.jsonl", requests), "rb") as f:
            input_file = client.files.create(file=f, purpose="batch")
        batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"team": "serve"})
        other = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"team": "other"})
        client.batches.cancel(other.id)
        deadline = time.time() + 240
        while batch.status not in ("completed", "failed", "expired", "cancelled") and time.time() < deadline:
            time.sleep(1)
            batch = client.batches.retrieve(batch.id)

        assert batch.status == "completed", (batch, (tmp_path / "serve.log").read_text()[-3000:])
        assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
        assert batch.model == CHAT_MODEL
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        err = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in requests)
        answers = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in out}
        assert "Paris" in answers["capital"]
        assert err[0]["custom_id"] == "too-long" and err[0]["response"]["status_code"] == 400
        assert batch.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)

        # Extensions, through the SDK: the list's filters, the partial output (here: the whole output, once
        # ended), and the webhook event's final counts and usage.
        assert [b.id for b in client.batches.list(extra_query={"metadata[team]": "serve"})] == [batch.id]
        assert [b.id for b in client.batches.list(extra_query={"status": "completed"})] == [batch.id]
        partial = client.get(f"/batches/{batch.id}/partial_output", cast_to=httpx.Response).text.splitlines()
        assert [json.loads(x) for x in partial] == out
        sdk = OpenAI(api_key="unused", webhook_secret=SECRET)
        deadline = time.time() + 30
        while len(receiver.events()) < 2 and time.time() < deadline:
            time.sleep(0.5)
        events = {e.data.id: e for e in (sdk.webhooks.unwrap(body.decode(), headers)
                                         for headers, body, _ in receiver.posts)}
        assert events[batch.id].type == "batch.completed" and events[other.id].type == "batch.cancelled"
        assert events[batch.id].data.model_extra == {"request_counts": batch.request_counts.model_dump(),
                                                     "usage": batch.usage.model_dump()}

        # The Dagster instance behind the UI has the batch as a partition, materialized by a sensor's run.
        monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])  # the instance's dagster.yaml reads it
        with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
            assert batch.id in instance.get_dynamic_partitions("batches")
            [run] = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": batch.id}))
            assert run.tags["dagster/sensor_name"] == "api_batch_sensor"
            assert batch.id in instance.get_materialized_partitions(dg.AssetKey("batch_usage"))
    finally:
        receiver.close()
        descendants = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C in `make serve` sends
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            log.close()
    assert rc == 0
    assert len(descendants) >= 3
    left = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"orphaned children: {left}"
