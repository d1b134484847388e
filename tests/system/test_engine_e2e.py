"""End to end on the real vLLM CPU engine with the embedded default models.

The engine starts once per model for the whole session (as in production, one per process).
"""

from __future__ import annotations

import base64
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from batch_dagster.batchfile.folder import BatchFolder, Progress
from batch_dagster.db import repo
from batch_dagster.db.session import open_database
from tests.helpers import (
    CHAT_MODEL,
    CONCISE,
    EMBED_MODEL,
    MODEL_CACHE,
    chat_request,
    make_defs,
    read_jsonl,
    real_vllm,
    run_on_real_engine,
    write_jsonl,
)

pytestmark = pytest.mark.engine


def content(line, i=0):
    return line["response"]["body"]["choices"][i]["message"]["content"]


def chat_rows_40():
    rows = [chat_request("capital", "What is the capital of France?", system=CONCISE, max_tokens=24, temperature=0)]
    rows.append(chat_request("short", "Tell me a long story about a dragon.", max_tokens=5, temperature=0))
    rows.append(chat_request("three", "Name a fruit.", max_tokens=12, n=3, temperature=0.8, seed=7))
    rows.append(chat_request("stop", "Count from one to ten, one number per line.", max_tokens=40,
                             temperature=0, stop=["\n"]))
    rows.append(chat_request("too-long", "word " * 2500, max_tokens=16))
    rows.append(chat_request("bad-temperature", "Hello", temperature=-1))
    rows.append(chat_request("greedy-n", "Hello", n=2, temperature=0))
    topics = ["the sea", "a mountain", "coffee", "a library", "winter", "a city at night", "a cat", "music"]
    for i in range(33):
        rows.append(chat_request(f"q-{i:02d}", f"Write one sentence about {topics[i % len(topics)]}.",
                                 max_tokens=16 + i % 3 * 8, temperature=0))
    return rows


def run_cli(tmp_path, rows):
    """`batch-dagster run --json` as a user runs it, with its own data dir and Dagster instance."""
    env = {**os.environ, "BATCH_DATA_DIR": str(tmp_path / "data"), "DAGSTER_HOME": str(tmp_path / "home"),
           "BATCH_MODEL_CACHE": str(MODEL_CACHE)}
    cli = Path(sys.executable).with_name("batch-dagster")
    proc = subprocess.run([str(cli), "run", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--out",
                           str(tmp_path / "out"), "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    out = {l["custom_id"]: l for l in read_jsonl(tmp_path / "out" / "output.jsonl")}
    err = {l["custom_id"]: l for l in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    return summary, out, err


def test_chat_batch_of_40_through_the_cli(tmp_path):
    rows = chat_rows_40()
    assert len(rows) == 40
    summary, out, err = run_cli(tmp_path, rows)

    assert summary["status"] == "completed"
    assert set(out).isdisjoint(err)
    assert sorted([*out, *err]) == sorted(r["custom_id"] for r in rows)
    assert summary["request_counts"] == {"total": 40, "completed": len(out), "failed": len(err)}
    assert set(err) == {"too-long", "bad-temperature", "greedy-n"}

    assert "Paris" in content(out["capital"])
    body = out["capital"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == CHAT_MODEL
    assert out["capital"]["response"]["status_code"] == 200 and out["capital"]["error"] is None
    assert out["capital"]["id"].startswith("batch_req_")

    short = out["short"]["response"]["body"]
    assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "length"
    assert len(out["three"]["response"]["body"]["choices"]) == 3
    stopped = out["stop"]["response"]["body"]["choices"][0]
    assert stopped["message"]["content"] and "\n" not in stopped["message"]["content"]
    assert stopped["finish_reason"] == "stop" and out["stop"]["response"]["body"]["usage"]["completion_tokens"] < 40

    too_long = err["too-long"]["response"]
    assert too_long["status_code"] == 400
    assert too_long["body"]["error"]["code"] == "context_length_exceeded"
    assert too_long["body"]["error"]["type"] == "invalid_request_error"
    bad = err["bad-temperature"]["response"]["body"]["error"]
    assert bad["code"] == "invalid_request" and "temperature" in bad["message"]

    # The run is recorded in the metadata store, the one record of batches (the API and the daily report read it).
    with open_database(f"sqlite:///{tmp_path / 'data' / 'batch-api.db'}").session() as session:
        batch = repo.get_batch(session, repo.ANONYMOUS, summary["batch_id"])
        assert batch.status == "completed" and batch.completed_at is not None
        assert (batch.request_total, batch.request_completed, batch.request_failed) == (40, len(out), len(err))
        assert batch.meta == {"source": (tmp_path / "in.jsonl").as_uri()}
        stored = repo.get_file(session, repo.ANONYMOUS, batch.input_file_id).path  # a key in the batch storage
        assert (tmp_path / "data" / stored).read_text() == (tmp_path / "in.jsonl").read_text()

    usage = summary["usage"]
    lines = [l["response"]["body"]["usage"] for l in out.values()]
    assert usage["input_tokens"] == sum(u["prompt_tokens"] for u in lines)
    assert usage["output_tokens"] == sum(u["completion_tokens"] for u in lines)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    cached = usage["input_tokens_details"]["cached_tokens"]  # the prefix cache's hits, at their own rate
    assert cached == sum((u["prompt_tokens_details"] or {}).get("cached_tokens") or 0 for u in lines)
    expected = ((usage["input_tokens"] - cached) * 0.10 + cached * 0.025 + usage["output_tokens"] * 0.40) / 1e6 * 0.5
    assert summary["cost"]["total_cost"] == pytest.approx(expected, rel=1e-6)
    assert summary["output_file"] == str(tmp_path / "out" / "output.jsonl") and summary["duration_s"] > 0

    # The run went to the CLI's Dagster instance, so `make dev` shows it later.
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as inst:
        runs = inst.get_runs()
        assert [r.tags.get("dagster/partition") for r in runs] == [summary["batch_id"]]
        assert runs[0].is_success


def test_completions_batch(tmp_path, data_dir, instance, monkeypatch):
    rows = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"model": CHAT_MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
         "body": {"model": CHAT_MODEL, "prompt": ["One, two,", "Monday, Tuesday,"], "max_tokens": 6, "temperature": 0}},
        {"custom_id": "c3", "method": "POST", "url": "/v1/completions",
         "body": {"model": CHAT_MODEL, "prompt": "x " * 3000, "max_tokens": 4}},
    ]
    written: list[Progress] = []
    write_progress = BatchFolder.write_progress

    def recorded(folder: BatchFolder, progress: Progress) -> None:
        written.append(progress)
        write_progress(folder, progress)

    monkeypatch.setattr(BatchFolder, "write_progress", recorded)
    summary, out, err = run_on_real_engine(tmp_path, data_dir, instance, rows)
    assert summary["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    b1 = out["c1"]["response"]["body"]
    assert b1["object"] == "text_completion" and "Paris" in b1["choices"][0]["text"]
    assert b1["usage"]["completion_tokens"] <= 8
    assert [c["index"] for c in out["c2"]["response"]["body"]["choices"]] == [0, 1]
    assert err["c3"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    # vLLM reported each finished prompt to the live progress (c1, and c2's two prompts), capped at
    # the shard's size: an approximate count while the shard runs, exact once it commits.
    assert max(p.done for p in written if p.shard == 0) == 3
    storage = make_defs(data_dir, real_vllm()).resources["storage"]
    final = storage.folder(summary["batch_id"]).progress()  # after the marker: the committed counts, nothing live
    assert (final.shard, final.shards_committed, final.counts().to_dict()) == (
        None, 1, {"total": 3, "completed": 2, "failed": 1})


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_batch(tmp_path, data_dir, instance):
    texts = {
        "cat1": "A cat is sleeping on the sofa.",
        "cat2": "The kitten naps on the couch.",
        "tax": "Quarterly tax filings are due next week.",
    }
    rows = [{"custom_id": k, "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBED_MODEL, "input": v}}
            for k, v in texts.items()]
    rows.append({"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": EMBED_MODEL, "input": [texts["cat1"], texts["tax"]], "encoding_format": "base64"}})
    summary, out, err = run_on_real_engine(tmp_path, data_dir, instance, rows)
    assert summary["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    vec = {k: out[k]["response"]["body"]["data"][0]["embedding"] for k in texts}
    assert all(len(v) == 384 for v in vec.values())
    assert _cos(vec["cat1"], vec["cat2"]) > _cos(vec["cat1"], vec["tax"]) + 0.3
    b64 = out["b64"]["response"]["body"]
    assert b64["object"] == "list" and [d["index"] for d in b64["data"]] == [0, 1]
    decoded = struct.unpack("<384f", base64.b64decode(b64["data"][0]["embedding"]))
    assert _cos(decoded, vec["cat1"]) > 0.999
    assert summary["usage"]["input_tokens"] > 0 and summary["usage"]["output_tokens"] == 0
