"""Client values in validation messages are quoted short, and a report lists a bounded number of errors."""

from __future__ import annotations

import json

import orjson
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.validate import MAX_ERRORS, MORE_ERRORS, validate_file

MODEL = "smollm2-135m-instruct"
HUGE = "x" * (1 << 20)
SHORT = 256  # no message quoting a client value is longer than this


def chat(cid: str = "a", **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": cid, "method": "POST", "url": c.CHAT, "body": body, **fields}


def report_of(tmp_path, rows, **kwargs):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return validate_file(path, **kwargs)


def test_quoted_keeps_a_short_value_whole_and_cuts_a_long_one_with_its_length():
    assert c.quoted("abc") == "'abc'"
    cut = c.quoted(HUGE)
    assert cut.startswith("'xxx") and cut.endswith(f"… ({len(HUGE)} characters)") and len(cut) < 100
    assert len(c.quoted(HUGE, limit=10)) < 40
    assert "\ud800" not in c.quoted("\ud800" * 100)  # repr escapes a lone surrogate: the message encodes


def chat_body(**body):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}


@pytest.mark.parametrize("rows", [
    [chat(url=HUGE)],
    [chat(url=c.COMPLETIONS), chat("b", url=c.CHAT)],  # the batch endpoint itself, quoted
    [chat(method=HUGE)],
    [chat(HUGE), chat(HUGE)],
    [chat(body={**chat_body(), "model": HUGE})],
    [chat(), chat("b", body={**chat_body(), "model": HUGE})],
    [{"custom_id": "a", "method": "POST", "url": c.RESPONSES, "body": {"model": MODEL, "input": [{"type": HUGE}]}}],
    [chat(body=chat_body(messages=[{"role": HUGE, "content": "hi"}]))],
    [chat(body=chat_body(messages=[{"role": "user", "content": [{"type": HUGE}]}]))],
], ids=["url", "endpoint", "method", "custom_id", "model", "mixed_model", "responses_type", "role", "part_type"])
def test_every_echo_of_a_client_value_is_short(tmp_path, rows):
    report = report_of(tmp_path, rows, models={MODEL: (c.CHAT, c.RESPONSES)})
    messages = [e.message for e in report.errors + report.rejected]
    assert messages
    assert all(len(m) < SHORT for m in messages), [m[:300] for m in messages]
    assert len(json.dumps(report.to_dict())) < 4096


def test_the_batch_endpoint_given_by_the_caller_is_quoted_short(tmp_path):
    report = report_of(tmp_path, [chat()], endpoint=HUGE)
    assert report.errors[0].code == c.INVALID_URL and len(report.errors[0].message) < SHORT


def test_a_report_lists_max_errors_and_says_how_many_more(tmp_path):
    report = report_of(tmp_path, [chat(f"r{i}", url=f"/v1/{i}") for i in range(5000)])
    listed = report.to_dict()
    assert MAX_ERRORS == 100 and report.error_count == listed["error_count"] == 5000
    assert len(listed["errors"]) == MAX_ERRORS + 1
    assert [e["line"] for e in listed["errors"][:MAX_ERRORS]] == list(range(1, MAX_ERRORS + 1))
    more = listed["errors"][-1]
    assert more["code"] == MORE_ERRORS and f"{5000 - MAX_ERRORS} more" in more["message"]
    assert len(json.dumps(listed)) < 32 * 1024


def test_a_report_within_the_cap_has_no_more_entry(tmp_path):
    report = report_of(tmp_path, [chat(url="/v1/nope")])
    assert [e["code"] for e in report.to_dict()["errors"]] == [c.INVALID_URL]


def test_a_model_name_longer_than_the_store_keeps_is_a_line_error(tmp_path):
    too_long = "m" * (c.MAX_MODEL_CHARS + 1)
    report = report_of(tmp_path, [chat("a"), chat("b", body={**chat_body(), "model": too_long})])
    [error] = report.errors
    assert (error.code, error.line, error.param) == (c.INVALID_REQUEST, 2, "body.model")
    assert str(c.MAX_MODEL_CHARS) in error.message and too_long not in error.message
    first = report_of(tmp_path, [chat(body={**chat_body(), "model": too_long})])
    assert first.model is None and [(e.line, e.param) for e in first.errors] == [(1, "body.model")]
    # The longest name the store keeps is a name like any other.
    fits = report_of(tmp_path, [chat(body={**chat_body(), "model": "m" * c.MAX_MODEL_CHARS})])
    assert fits.valid and fits.model == "m" * c.MAX_MODEL_CHARS
    assert c.model_of_head(orjson.dumps(chat(body={**chat_body(), "model": too_long})), whole=True) is None


def test_ten_thousand_bad_lines_with_twenty_megabytes_of_values_make_a_small_report(tmp_path):
    """What a batch object lists comes from this report: it stays small whatever the file holds."""
    value = "v" * 2048  # 10,000 of them: 20 MB of client values, each echoed in an error
    lines = [chat(f"r{i}", url=f"/v1/{value}") for i in range(10_000)]
    report = report_of(tmp_path, lines)
    assert report.error_count == 10_000
    listed = report.to_dict()
    assert len(listed["errors"]) == MAX_ERRORS + 1 and listed["errors"][-1]["code"] == MORE_ERRORS
    assert len(json.dumps(listed)) < 32 * 1024
