"""Every JSONL line the service writes is one line to every common reader: the characters Python's str.splitlines()
breaks at (and JSON leaves raw) are escaped as \\uXXXX, and each line is still the same JSON value. Main wrote U+2028,
U+2029 and U+0085 raw, so a reader that splits with splitlines() (inspect_ai's batch mode does) got halves of lines."""

from __future__ import annotations

import json

import orjson

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import results
from batch_dagster.batchfile import table as t
from batch_dagster.batchfile.table import TableRequest
from batch_dagster.storage import LocalStorage

# Every character str.splitlines() breaks at but "\n" and "\r" (which no JSON writer leaves raw).
BREAKS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e"
TEXT = f"one{BREAKS}two"


def lines_of(data: bytes) -> list[dict]:
    """What a reader that splits with str.splitlines() reads: every piece must be a whole JSON line."""
    return [json.loads(piece) for piece in data.decode("utf-8").splitlines()]


def test_a_jsonl_line_is_one_line_to_splitlines_and_the_same_value():
    line = {"custom_id": f"id{BREAKS}", "body": {"text": TEXT, "list": [BREAKS, {"k": "\u2028"}]}}
    raw = c.jsonl_line(line)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert lines_of(raw) == [line] and orjson.loads(raw) == line
    for ch in BREAKS:
        assert ch.encode() not in raw, repr(ch)
    assert b"\\u2028" in raw and b"\\u2029" in raw and b"\\u0085" in raw
    # Other non-ASCII text is left as it is (escaping only what splits lines), and so is JSON without any.
    assert c.one_line(orjson.dumps({"t": "Paris é 東京 \u2027"})) == orjson.dumps({"t": "Paris é 東京 \u2027"})


def test_shard_output_error_and_merged_files_split_into_their_lines(tmp_path):
    folder = tmp_path / "results"
    ok = c.success_line(f"a{BREAKS}", {"choices": [{"message": {"content": TEXT}}], "usage": {}})
    bad = c.request_error_line(f"b{BREAKS}", c.INVALID_REQUEST, f"no {TEXT}", param="temperature")
    storage, prefix = LocalStorage(tmp_path), folder.name
    results.commit_shard(storage, prefix, 0, [ok, bad], 0.1)
    out_key, err_key, _ = results.shard_keys(prefix, 0)
    assert lines_of((tmp_path / out_key).read_bytes()) == [ok]
    assert lines_of((tmp_path / err_key).read_bytes()) == [bad]

    never = c.not_run_line(f"c{BREAKS}", "batch_cancelled", f"cancelled {TEXT}")
    out, err = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    results.merge(storage, prefix, 1, out, err, not_run=[never])
    assert lines_of(out.read_bytes()) == [ok]
    assert lines_of(err.read_bytes()) == [bad, never]


def test_a_table_batch_input_splits_into_its_requests(tmp_path):
    spec = TableRequest.from_dict({"model": "m", "user": "Review: {text}"})
    rendered = t.render(spec, [{"text": TEXT}, {"text": "plain"}])
    requests = lines_of(rendered.payload())
    assert [r["custom_id"] for r in requests] == ["row-0", "row-1"]
    assert requests[0]["body"]["messages"][-1]["content"] == f"Review: {TEXT}"


def test_the_line_splitter_breaks_at_these_characters():
    # Why: if Python stopped breaking at one of them, this test tells, and the escapes could go.
    assert len(f"a{BREAKS}b".splitlines()) == len(BREAKS) + 1
