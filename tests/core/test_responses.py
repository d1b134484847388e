"""/v1/responses lines: validation with line and param, the chat body they run as, usage from `response` objects."""

from __future__ import annotations

import json

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.columnar import read_shard, validate_to_parquet, write_shards
from batch_dagster.batchfile.contract import endpoint_of_head
from batch_dagster.batchfile.fields import Serves
from batch_dagster.batchfile.responses import chat_body
from batch_dagster.batchfile.shard import features
from batch_dagster.batchfile.usage import Usage
from batch_dagster.batchfile.validate import validate_file
from batch_dagster.engine.lines import RequestError, check

MODEL = "smollm2-135m-instruct"


def line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": c.RESPONSES, "body": {"model": MODEL, "input": "hi", **body}}


def nested(levels: int) -> object:
    value: object = []
    for _ in range(levels - 1):
        value = [value]
    return value


def validate(tmp_path, rows):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return validate_file(path, models={MODEL: ("/v1/chat/completions", c.RESPONSES)})


def test_valid_responses_file(tmp_path):
    items = [{"role": "user", "content": "a"}, {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "b"}]}, {"role": "user", "content": [{"type": "input_text", "text": "c"}]}]
    report = validate(tmp_path, [line("a", instructions="Be brief.", max_output_tokens=5, temperature=0, top_p=1),
                                 line("b", input=items)])
    assert report.valid, report.errors
    assert report.endpoint == c.RESPONSES and report.total_requests == 2


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 3}, "body.input"),
    ({"input": ""}, "body.input"),
    ({"input": []}, "body.input"),
    ({"input": ["text"]}, "body.input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "body.input[0].role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "body.input[0].call_id"),
    ({"input": [{"type": "web_search_call", "id": "f"}]}, "body.input[0].type"),
    # The model takes no images (its registry entry says none).
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "body.input[0].content[0]"),
    ({"instructions": ["not", "a", "string"]}, "body.instructions"),
    ({"max_output_tokens": 0}, "body.max_output_tokens"),
    ({"max_output_tokens": "5"}, "body.max_output_tokens"),
    ({"max_output_tokens": True}, "body.max_output_tokens"),
    ({"temperature": 3}, "body.temperature"),
    ({"temperature": "hot"}, "body.temperature"),
    ({"top_p": 1.5}, "body.top_p"),
    ({"stream": True}, "body.stream"),
    ({"previous_response_id": "resp_1"}, "body.previous_response_id"),
    ({"metadata": {"k": nested(64)}}, "body.metadata"),  # the one nesting limit of every endpoint
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "x": nested(62)}]}]},
     "body.input[0]"),
])
def test_each_bad_field_is_reported_with_its_line_and_param(tmp_path, body, param):
    # As for the other endpoints: the file stays valid, the request is kept and ends as its own 400 line.
    report = validate(tmp_path, [line("ok"), line("bad", **body)])
    assert report.valid and report.total_requests == 2
    assert [(e.code, e.line, e.param) for e in report.rejected] == [(c.INVALID_REQUEST, 2, param)]
    with pytest.raises(RequestError) as refused:
        check(c.RESPONSES, line("bad", **body)["body"], Serves((c.CHAT, c.RESPONSES)))
    assert refused.value.param == param.removeprefix("body.")


def test_a_body_too_deep_to_store_is_stored_cut_and_still_refused(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line("ok")) + "\n" + json.dumps(line("deep", metadata={"k": nested(400)})) + "\n")
    report = validate_to_parquet(path, tmp_path / "requests.parquet", models={MODEL: (c.RESPONSES,)})
    assert report.valid and [(e.line, e.param) for e in report.rejected] == [(2, "body.metadata")]
    write_shards(tmp_path / "requests.parquet", tmp_path / "shards", shard_size=2)
    stored = dict(cid_body for shard in (tmp_path / "shards").iterdir() for cid_body in read_shard(shard))
    with pytest.raises(RequestError, match="nested deeper than 64 levels"):
        check(c.RESPONSES, stored["deep"])
    check(c.RESPONSES, stored["ok"])


def test_missing_input_is_reported(tmp_path):
    row = line("a")
    del row["body"]["input"]
    report = validate(tmp_path, [row])
    assert [(e.line, e.param) for e in report.errors] == [(1, "body.input")]


def test_a_chat_only_model_list_rejects_responses(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line("a")) + "\n")
    report = validate_file(path, models={MODEL: ("/v1/chat/completions",)})
    assert [(e.code, e.param) for e in report.errors] == [(c.INVALID_URL, "url")]


def test_endpoint_of_head_knows_responses():
    assert endpoint_of_head((json.dumps(line("a")) + "\n").encode()) == c.RESPONSES


def test_instructions_become_the_system_message_and_input_the_messages():
    body = line("a", instructions="Be brief.", max_output_tokens=7, temperature=0.5,
                input=[{"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_text",
                                                                                      "text": "y"}]}])["body"]
    assert chat_body(body) == {"model": MODEL, "temperature": 0.5, "max_tokens": 7, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "xy"}]}
    assert chat_body(line("b", input="plain")["body"])["messages"] == [{"role": "user", "content": "plain"}]


def test_responses_shard_like_their_chat_body():
    body = line("a", instructions="Shared system prompt")["body"]
    assert features(c.RESPONSES, body) == features(c.CHAT, chat_body(body))


def test_usage_counts_response_objects_beside_chat_bodies():
    # A `response` object's usage, as vLLM's server writes it (only the fields usage reads).
    response = {"object": "response", "usage": {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 2},
                                                 "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 1},
                                                 "total_tokens": 14}}
    usage = Usage()
    usage.add_body(response)
    usage.add_body({"usage": {"prompt_tokens": 5, "completion_tokens": 4}})  # a chat body beside it
    assert (usage.input_tokens, usage.output_tokens, usage.cached_tokens, usage.reasoning_tokens) == (16, 7, 2, 1)


def test_any_stored_responses_body_shards_and_counts_as_text(tmp_path):
    # Tool-conversation items, and mistyped ones (refused at their line, stored all the same), never fail the file.
    items = [{"type": "message", "role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    assert [m["role"] for m in chat_body(line("a", input=items)["body"])["messages"]] == ["user", "assistant", "tool"]
    rows = [line("ok", input=items), line("bad", input=["text", 5, {"role": 7}]), line("worse", input={"x": 1},
                                                                                      instructions=3)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = validate_to_parquet(path, tmp_path / "requests.parquet", models={MODEL: (c.RESPONSES,)})
    assert report.valid and [e.line for e in report.rejected] == [2, 3]
