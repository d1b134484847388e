"""The Parquet steps of the core: validated requests and shard files."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from batch_dagster.batchfile import columnar
from batch_dagster.batchfile.columnar import custom_ids, read_shard, shard_path, validate_to_parquet, write_shards


def chat(cid, system, user):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": messages}}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_valid_file_becomes_parquet_in_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(columnar, "ROWS_PER_GROUP", 4)
    rows = [chat(f"r{i}", None, "x" * i) for i in range(10)]
    out = tmp_path / "requests.parquet"
    report = validate_to_parquet(write(tmp_path / "in.jsonl", rows), out, models={"m"})
    assert report.valid and report.total_requests == 10
    f = pq.ParquetFile(out)
    assert f.num_row_groups == 3  # 4 + 4 + 2: bounded buffers
    table = f.read()
    assert table["custom_id"].to_pylist() == [f"r{i}" for i in range(10)]
    assert table["line"].to_pylist() == list(range(1, 11))
    assert json.loads(table["body"][3].as_py()) == rows[3]["body"]
    assert table["prompt_chars"].to_pylist() == list(range(10))


def test_invalid_file_leaves_no_parquet(tmp_path):
    out = tmp_path / "requests.parquet"
    report = validate_to_parquet(write(tmp_path / "in.jsonl", [chat("a", None, "x"), chat("a", None, "y")]), out)
    assert not report.valid and not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_shards_hold_every_request_once_and_keep_prefix_groups_together(tmp_path, monkeypatch):
    monkeypatch.setattr(columnar, "ROWS_PER_GROUP", 3)  # shards gather rows from several row groups
    rows = []
    for i in range(12):
        system = "You are a translator." if i % 2 else None
        rows.append(chat(f"r{i:02d}", system, f"text {i} " + "y" * (i * 3)))
    requests = tmp_path / "requests.parquet"
    assert validate_to_parquet(write(tmp_path / "in.jsonl", rows), requests).valid
    sizes = write_shards(requests, tmp_path / "shards", shard_size=4)
    assert sizes == [4, 4, 4]
    shards = [read_shard(shard_path(tmp_path / "shards", i)) for i in range(3)]
    ids = [cid for shard in shards for cid, _ in shard]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)
    # The six translator requests share a prefix: they fill the first shard and part of the second.
    translator = {r["custom_id"] for r in rows if len(r["body"]["messages"]) == 2}
    assert {cid for cid, _ in shards[0]} <= translator
    assert shards[0][0][1]["messages"][0]["content"] == "You are a translator."
    assert custom_ids(shard_path(tmp_path / "shards", 2)) == [cid for cid, _ in shards[2]]


def test_the_first_shard_holds_the_most_output_asked_and_an_older_requests_file_still_shards(tmp_path):
    rows = [{**chat(f"r{i}", None, f"{i} " + "z" * 10), "body": {"model": "m", "max_tokens": 10 * (i + 1),
            "messages": [{"role": "user", "content": f"{i} question"}]}} for i in range(6)]
    requests = tmp_path / "requests.parquet"
    assert validate_to_parquet(write(tmp_path / "in.jsonl", rows), requests).valid
    assert pq.read_table(requests)["max_tokens"].to_pylist() == [10, 20, 30, 40, 50, 60]
    assert write_shards(requests, tmp_path / "shards", shard_size=3) == [3, 3]
    assert sorted(custom_ids(shard_path(tmp_path / "shards", 0))) == ["r3", "r4", "r5"]  # the longest work first
    # A requests file written before max_tokens was kept (a batch resumed across an upgrade) shards by prompt.
    older = tmp_path / "older.parquet"
    pq.write_table(pq.read_table(requests).drop(["max_tokens"]), older)
    assert write_shards(older, tmp_path / "older-shards", shard_size=3) == [3, 3]
