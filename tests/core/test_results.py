"""Shard commits, committed-shard discovery and the merged output/error files (plus the line shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import results
from batch_dagster.batchfile.results import CommittedShard, RequestCounts, error_code
from batch_dagster.batchfile.usage import Usage
from batch_dagster.storage import LocalStorage

# The results functions take a storage and a folder in it; here a results folder is a local directory.


def _at(folder: Path) -> tuple[LocalStorage, str]:
    return LocalStorage(folder.parent), folder.name


def commit_shard(folder: Path, *args, **kwargs):
    return results.commit_shard(*_at(folder), *args, **kwargs)


def committed_shards(folder: Path):
    return results.committed_shards(*_at(folder))


def merge(folder: Path, *args, **kwargs):
    return results.merge(*_at(folder), *args, **kwargs)


def shard_paths(folder: Path, index: int) -> tuple[Path, ...]:
    return tuple(folder.parent / key for key in results.shard_keys(folder.name, index))


def iter_lines(path: Path):
    return results.iter_lines(LocalStorage(path.parent), path.name)


def chat_ok(cid: str, prompt: int, completion: int, cached: int = 0) -> dict:
    body = {
        "id": f"chatcmpl-{cid}",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    return c.success_line(cid, body)


def embed_ok(cid: str, prompt: int) -> dict:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
        "model": "e",
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }
    return c.success_line(cid, body)


def rejected(cid: str, code: str = c.CONTEXT_LENGTH_EXCEEDED) -> dict:
    return c.request_error_line(cid, code, "too long", param="messages")


def never_ran(cid: str, code: str = c.BATCH_CANCELLED) -> dict:
    return c.not_run_line(cid, code, "The batch was cancelled before this request ran.")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ids(path: Path) -> list[str]:
    return [x["custom_id"] for x in read_jsonl(path)]


# --- contract line shapes -------------------------------------------------------------------


def test_success_line_shape():
    line = c.success_line("req-1", {"object": "chat.completion"})
    assert line["custom_id"] == "req-1"
    assert line["id"].startswith("batch_req_") and len(line["id"]) > len("batch_req_")
    assert line["response"]["status_code"] == 200
    assert line["response"]["request_id"].startswith("req_")
    assert line["response"]["body"] == {"object": "chat.completion"}
    assert line["error"] is None
    assert c.is_success(line)
    assert c.success_line("req-1", {})["id"] != line["id"]


def test_request_error_line_shape():
    line = c.request_error_line("r", "invalid_request", "temperature must be >= 0", param="temperature")
    assert line["error"] is None
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"] == {
        "error": {
            "message": "temperature must be >= 0",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_request",
        }
    }
    assert not c.is_success(line)
    server = c.request_error_line("r", c.ENGINE_ERROR, "crashed", status_code=500)
    assert server["response"]["status_code"] == 500
    assert server["response"]["body"]["error"]["type"] == "server_error"
    assert server["response"]["body"]["error"]["param"] is None


def test_not_run_line_shape():
    line = c.not_run_line("r", c.BATCH_EXPIRED, "expired")
    assert line["response"] is None
    assert line["error"] == {"code": "batch_expired", "message": "expired"}
    assert not c.is_success(line)


def test_is_success_needs_status_200_and_no_error():
    line = chat_ok("a", 1, 1)
    line["error"] = {"code": "x", "message": "y"}
    assert not c.is_success(line)
    assert not c.is_success({"custom_id": "a", "response": {"status_code": 0, "body": {}}, "error": None})


# --- error_code -----------------------------------------------------------------------------


def test_error_code_both_shapes():
    assert error_code(rejected("a", "context_length_exceeded")) == "context_length_exceeded"
    assert error_code(never_ran("b", "batch_expired")) == "batch_expired"
    assert error_code({"response": {"status_code": 500, "body": {}}, "error": None}) == "unknown"
    assert error_code({"response": None, "error": None}) == "unknown"


# --- commit_shard ---------------------------------------------------------------------------


def test_commit_shard_writes_output_errors_and_summary(tmp_path):
    results = tmp_path / "results"  # created on demand
    lines = [
        chat_ok("a", 10, 5, cached=4),
        rejected("b", "context_length_exceeded"),
        chat_ok("c", 7, 3),
        never_ran("d", "batch_cancelled"),
        rejected("e", "invalid_request"),
        rejected("f", "context_length_exceeded"),
    ]
    summary = commit_shard(results, 3, lines, duration_s=1.23456)
    out, err, summ = shard_paths(results, 3)
    assert (out.name, err.name, summ.name) == (
        "shard-00003.output.jsonl",
        "shard-00003.errors.jsonl",
        "shard-00003.json",
    )
    assert ids(out) == ["a", "c"]
    assert ids(err) == ["b", "d", "e", "f"]
    assert read_jsonl(out)[0] == lines[0]
    assert read_jsonl(err)[1] == lines[3]

    assert summary.index == 3
    assert summary.request_counts.to_dict() == {"total": 6, "completed": 2, "failed": 4}
    assert summary.usage.input_tokens == 17
    assert summary.usage.output_tokens == 8
    assert summary.usage.cached_tokens == 4
    assert summary.usage.total_tokens == 25
    assert summary.error_codes == {"context_length_exceeded": 2, "batch_cancelled": 1, "invalid_request": 1}
    assert summary.duration_s == pytest.approx(1.235)

    on_disk = json.loads(summ.read_text())
    assert on_disk == summary.to_dict()
    assert on_disk["usage"]["total_tokens"] == 25
    assert not list(results.glob("*.tmp"))


def test_usage_counts_success_lines_only(tmp_path):
    failed_with_usage = {
        "id": "x",
        "custom_id": "f",
        "response": {
            "status_code": 500,
            "request_id": "r",
            "body": {"error": {"code": "engine_error"}, "usage": {"prompt_tokens": 1000, "completion_tokens": 1000}},
        },
        "error": None,
    }
    summary = commit_shard(tmp_path, 0, [embed_ok("a", 6), failed_with_usage, embed_ok("b", 4)])
    assert summary.usage.input_tokens == 10
    assert summary.usage.output_tokens == 0
    assert summary.error_codes == {"engine_error": 1}
    assert summary.request_counts.to_dict() == {"total": 3, "completed": 2, "failed": 1}


def test_commit_empty_shard(tmp_path):
    summary = commit_shard(tmp_path, 0, [])
    out, err, summ = shard_paths(tmp_path, 0)
    assert out.read_bytes() == b"" and err.read_bytes() == b""
    assert summ.exists()
    assert summary.request_counts.to_dict() == {"total": 0, "completed": 0, "failed": 0}
    assert 0 in committed_shards(tmp_path)


def test_commit_accepts_a_generator(tmp_path):
    summary = commit_shard(tmp_path, 1, (chat_ok(f"r{i}", 1, 2) for i in range(4)))
    assert summary.request_counts.completed == 4
    assert ids(shard_paths(tmp_path, 1)[0]) == ["r0", "r1", "r2", "r3"]


def test_recommit_replaces_not_appends(tmp_path):
    commit_shard(tmp_path, 0, [chat_ok("a", 1, 1), rejected("b")])
    commit_shard(tmp_path, 0, [chat_ok("a", 2, 2), chat_ok("b", 3, 3)])
    out, err, _ = shard_paths(tmp_path, 0)
    assert ids(out) == ["a", "b"]
    assert read_jsonl(err) == []
    assert committed_shards(tmp_path)[0].usage.input_tokens == 5


def test_output_lines_are_one_json_object_per_line(tmp_path):
    commit_shard(tmp_path, 0, [chat_ok("a", 1, 1), chat_ok("b", 1, 1)])
    raw = shard_paths(tmp_path, 0)[0].read_bytes()
    assert raw.endswith(b"\n")
    assert raw.count(b"\n") == 2


# --- committed_shards -----------------------------------------------------------------------


def test_committed_shards_missing_dir(tmp_path):
    assert committed_shards(tmp_path / "nope") == {}


def test_committed_shards_finds_only_committed(tmp_path):
    s0 = commit_shard(tmp_path, 0, [chat_ok("a", 3, 4)], duration_s=0.5)
    commit_shard(tmp_path, 2, [rejected("b")])
    # Shard 1: a crash left its lines and a half-written summary, never renamed into place.
    out1, err1, summ1 = shard_paths(tmp_path, 1)
    out1.write_text(json.dumps(chat_ok("x", 1, 1)) + "\n")
    err1.write_text("")
    summ1.with_name(summ1.name + ".tmp").write_text('{"index": 1, "request_')
    # Shard 3: lines written, no summary at all.
    out3, err3, _ = shard_paths(tmp_path, 3)
    out3.write_text("")
    err3.write_text("")
    # Unrelated files are ignored.
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "shard-7.json").write_text("{}")

    found = committed_shards(tmp_path)
    assert sorted(found) == [0, 2]
    assert found[0].to_dict() == s0.to_dict()
    assert found[0].usage.total_tokens == 7
    assert found[2].error_codes == {"context_length_exceeded": 1}
    assert found[2].request_counts.failed == 1


def test_committed_shard_with_large_index(tmp_path):
    commit_shard(tmp_path, 123_456, [chat_ok("a", 1, 1)])
    assert list(committed_shards(tmp_path)) == [123_456]


def test_shard_summary_round_trip():
    s = CommittedShard(
        index=4,
        request_counts=RequestCounts(5, 3, 2),
        usage=Usage(input_tokens=10, output_tokens=20, cached_tokens=1, reasoning_tokens=2),
        error_codes={"engine_error": 2},
        duration_s=1.5,
    )
    back = CommittedShard.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s


def test_request_counts_iadd():
    a = RequestCounts(3, 2, 1)
    a += RequestCounts(4, 1, 3)
    assert a.to_dict() == {"total": 7, "completed": 3, "failed": 4}


# --- merge ----------------------------------------------------------------------------------


def _three_shards(results: Path) -> None:
    # Committed out of order on purpose: merge must follow shard order, not commit order.
    commit_shard(results, 2, [chat_ok("s2-a", 100, 10), rejected("s2-b", "invalid_request")])
    commit_shard(results, 0, [chat_ok("s0-a", 1, 2), chat_ok("s0-b", 3, 4), rejected("s0-c")])
    commit_shard(results, 1, [never_ran("s1-a", "engine_error"), chat_ok("s1-b", 5, 6, cached=2)])


def test_merge_concatenates_in_shard_order(tmp_path):
    results = tmp_path / "results"
    _three_shards(results)
    out, err = tmp_path / "out" / "output.jsonl", tmp_path / "out" / "errors.jsonl"
    res = merge(results, 3, out, err)
    assert ids(out) == ["s0-a", "s0-b", "s1-b", "s2-a"]
    assert ids(err) == ["s0-c", "s1-a", "s2-b"]
    assert res.request_counts.to_dict() == {"total": 7, "completed": 4, "failed": 3}
    assert (res.usage.input_tokens, res.usage.output_tokens, res.usage.cached_tokens) == (109, 22, 2)
    assert res.error_codes == {"context_length_exceeded": 1, "engine_error": 1, "invalid_request": 1}
    assert not list(out.parent.glob("*.tmp"))


def test_merged_usage_equals_sum_over_output_lines(tmp_path):
    _three_shards(tmp_path / "r")
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    res = merge(tmp_path / "r", 3, out, err)
    total = Usage()
    for line in iter_lines(out):
        total.add_body(line["response"]["body"])
    assert total == res.usage
    assert res.usage.total_tokens == sum(x["response"]["body"]["usage"]["total_tokens"] for x in read_jsonl(out))


def test_merge_twice_gives_same_content(tmp_path):
    _three_shards(tmp_path / "r")
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    extra = [never_ran("late", "batch_expired")]
    first = merge(tmp_path / "r", 3, out, err, not_run=extra)
    out_bytes, err_bytes = out.read_bytes(), err.read_bytes()
    second = merge(tmp_path / "r", 3, out, err, not_run=extra)
    assert out.read_bytes() == out_bytes
    assert err.read_bytes() == err_bytes
    assert len(read_jsonl(out)) == 4
    assert second.request_counts == first.request_counts
    assert second.usage == first.usage


def test_merge_overwrites_stale_files(tmp_path):
    commit_shard(tmp_path / "r", 0, [chat_ok("a", 1, 1)])
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    out.write_text('{"custom_id": "stale"}\n' * 3)
    err.write_text('{"custom_id": "stale"}\n')
    merge(tmp_path / "r", 1, out, err)
    assert ids(out) == ["a"]
    assert err.read_bytes() == b""


def test_merge_adds_not_run_lines_as_failed(tmp_path):
    commit_shard(tmp_path / "r", 0, [chat_ok("a", 2, 3), rejected("b")])
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    not_run = [never_ran("c", "batch_cancelled"), never_ran("d", "batch_cancelled"), never_ran("e", "batch_expired")]
    res = merge(tmp_path / "r", 2, out, err, not_run=not_run, missing_ok=True)
    assert ids(out) == ["a"]
    assert ids(err) == ["b", "c", "d", "e"]
    assert read_jsonl(err)[1] == not_run[0]
    assert res.request_counts.to_dict() == {"total": 5, "completed": 1, "failed": 4}
    assert res.error_codes == {"context_length_exceeded": 1, "batch_cancelled": 2, "batch_expired": 1}
    assert res.usage.total_tokens == 5


def test_merge_with_no_shards_writes_empty_files(tmp_path):
    out, err = tmp_path / "x" / "o.jsonl", tmp_path / "x" / "e.jsonl"
    res = merge(tmp_path / "none", 0, out, err)
    assert out.read_bytes() == b"" and err.read_bytes() == b""
    assert res.request_counts.to_dict() == {"total": 0, "completed": 0, "failed": 0}


def test_merge_ignores_shards_beyond_shard_count(tmp_path):
    commit_shard(tmp_path / "r", 0, [chat_ok("a", 1, 1)])
    commit_shard(tmp_path / "r", 5, [chat_ok("stray", 1, 1)])
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    res = merge(tmp_path / "r", 1, out, err)
    assert ids(out) == ["a"]
    assert res.request_counts.total == 1


def test_every_custom_id_exactly_once_across_both_files(tmp_path):
    expected = []
    for shard in range(4):
        lines = []
        for j in range(5):
            cid = f"r{shard}-{j}"
            expected.append(cid)
            lines.append(chat_ok(cid, j, j) if j % 2 == 0 else rejected(cid))
        commit_shard(tmp_path / "r", shard, lines)
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    res = merge(tmp_path / "r", 4, out, err)
    got = ids(out) + ids(err)
    assert sorted(got) == sorted(expected)
    assert len(got) == len(set(got)) == res.request_counts.total == 20


def test_iter_lines_skips_blank_lines(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\r\n  \n')
    assert list(iter_lines(path)) == [{"a": 1}, {"a": 2}]


def test_merge_refuses_a_missing_shard_unless_allowed(tmp_path):
    commit_shard(tmp_path / "r", 0, [c.success_line("a", {"usage": {}})])
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    with pytest.raises(ValueError, match="not committed"):
        merge(tmp_path / "r", 2, out, err)
    assert merge(tmp_path / "r", 2, out, err, missing_ok=True).request_counts.total == 1
