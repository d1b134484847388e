"""Structured answers: which requests ask for a structure, the one check every answer passes (a JSON schema, a JSON
object, a choice, forced tool calls against their tools' parameters), the mark a line gets and the counts a batch
keeps (request_counts.incomplete_structured and invalid_structured)."""

from __future__ import annotations

import orjson
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.results import commit_shard, committed_shards, iter_lines, progress_of, shard_keys
from batch_dagster.batchfile.structured import MAX_REASON, Violation, asks_structured, cut_short, expected
from batch_dagster.storage import LocalStorage

LABEL = {"type": "object", "properties": {"label": {"enum": ["positive", "negative"]},
                                          "score": {"type": "number", "minimum": 0, "maximum": 1},
                                          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
         "required": ["label", "score"], "additionalProperties": False}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": LABEL, "strict": True}}
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "hours": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["hours"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_which_requests_ask_for_structured_output():
    assert asks_structured(c.CHAT, {"response_format": SCHEMA})
    assert asks_structured(c.CHAT, {"response_format": {"type": "json_object"}})
    assert not asks_structured(c.CHAT, {"response_format": {"type": "text"}})
    assert asks_structured(c.COMPLETIONS, {"structured_outputs": {"regex": "[0-9]+"}})
    assert asks_structured(c.CHAT, {"tools": [TOOL], "tool_choice": "required"})
    assert asks_structured(c.CHAT, {"tools": [TOOL], "tool_choice": NAMED})
    assert not asks_structured(c.CHAT, {"tools": [TOOL], "tool_choice": "auto"})
    assert asks_structured(c.RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}})
    assert not asks_structured(c.RESPONSES, {"text": {"format": {"type": "text"}}})
    assert not asks_structured(c.CHAT, {"messages": []})


def chat(content: str | None = None, finish: str = "stop", calls: list | None = None, n: int = 1) -> dict:
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls or [])]}
    return {"object": "chat.completion", "choices": [{"index": i, "message": message, "finish_reason": finish}
                                                     for i in range(n)],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


def violation(endpoint: str, body: dict, answer: dict) -> Violation | None:
    wanted = expected(endpoint, body)
    assert wanted is not None
    return wanted.check(answer)


def test_a_json_schema_answer_is_checked_against_its_schema_with_the_first_violation_named():
    body = {"response_format": SCHEMA}
    assert violation(c.CHAT, body, chat('{"label": "positive", "score": 0.5, "tags": ["a"]}')) is None
    v = violation(c.CHAT, body, chat('{"label": "happy", "score": 0.5}'))
    assert v == Violation("/choices/0/message/content", "/label", "'happy' is not one of ['positive', 'negative']")
    assert v.dotted == "answer.label"
    v = violation(c.CHAT, body, chat('{"label": "positive", "score": 1.5}'))
    assert (v.pointer, v.reason) == ("/score", "1.5 is greater than the maximum of 1")
    v = violation(c.CHAT, body, chat('{"label": "positive", "score": 1, "tags": ["a", "b", "c"]}'))
    assert v.pointer == "/tags" and "is too long" in v.reason
    v = violation(c.CHAT, body, chat('{"label": "positive"}'))
    assert (v.pointer, v.reason) == ("", "'score' is a required property")
    assert violation(c.CHAT, body, chat("Positive!")).reason.startswith("not JSON: ")
    assert violation(c.CHAT, body, chat(None)).reason == "no answer text"
    # Every choice is checked: the second one's violation is named by its index.
    two = chat('{"label": "positive", "score": 0.5}', n=2)
    two["choices"][1]["message"] = {"content": '{"label": "positive", "score": -1}'}
    assert violation(c.CHAT, body, two).answer == "/choices/1/message/content"
    # Not strict: checked all the same (vLLM constrains it all the same).
    loose = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": LABEL}}}
    assert violation(c.CHAT, loose, chat('{"label": "positive", "score": 2}')).pointer == "/score"


def test_json_object_choice_and_completions_answers_are_checked_too():
    obj = {"response_format": {"type": "json_object"}}
    assert violation(c.CHAT, obj, chat('{"a": 1}')) is None
    assert violation(c.CHAT, obj, chat("[1, 2]")).reason == "[1, 2] is not of type 'object'"
    completion = {"object": "text_completion", "choices": [{"index": 0, "text": '{"label": "x", "score": 0}', "finish_reason":
                                                            "stop"}]}
    v = violation(c.COMPLETIONS, {"response_format": SCHEMA}, completion)
    assert (v.answer, v.pointer) == ("/choices/0/text", "/label")
    so = {"structured_outputs": {"json": orjson.dumps(LABEL).decode()}}  # vLLM's own field, its schema as text
    assert violation(c.COMPLETIONS, so, completion).pointer == "/label"
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    assert violation(c.CHAT, choice, chat("yes")) is None and "'maybe' is not one of" in \
        violation(c.CHAT, choice, chat("maybe")).reason
    # A regex or a grammar is not checked here (only counted when cut).
    assert violation(c.CHAT, {"structured_outputs": {"regex": "[0-9]+"}}, chat("abc")) is None


def response(*items: dict, status: str = "completed") -> dict:
    return {"object": "response", "status": status, "output": list(items)}


def test_responses_text_format_and_function_calls_are_checked():
    fmt = {"text": {"format": {"type": "json_schema", "name": "x", "schema": LABEL, "strict": True}}}
    text = {"type": "message", "content": [{"type": "output_text", "text": '{"label": "positive", "score": 7}'}]}
    v = violation(c.RESPONSES, fmt, response({"type": "reasoning"}, text))
    assert (v.answer, v.pointer) == ("/output/1/content/0/text", "/score")
    tools = {"tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}], "tool_choice": "required"}
    call = {"type": "function_call", "name": "get_weather", "arguments": '{"location": "Paris"}'}
    assert violation(c.RESPONSES, tools, response(call)) is None
    v = violation(c.RESPONSES, tools, response({**call, "arguments": '"Paris"'}))
    assert (v.answer, v.reason) == ("/output/0/arguments", "'Paris' is not of type 'object'")
    assert violation(c.RESPONSES, {**tools, "tool_choice": {"type": "function", "name": "get_weather"}},
                     response(text)).reason == "no tool call, though tool_choice asked for one"


def test_forced_tool_calls_follow_their_tools_parameters():
    required = {"tools": [TOOL, TIME], "tool_choice": "required"}
    ok = chat(calls=[("get_weather", '{"location": "Paris"}'), ("get_time", '{"hours": 3}')], finish="tool_calls")
    assert violation(c.CHAT, required, ok) is None
    # What vLLM 0.32 answered for a non-strict tool before --tool-strict-level parameter: a JSON string.
    v = violation(c.CHAT, {"tools": [TOOL], "tool_choice": NAMED}, chat(calls=[("get_weather", '"Paris"')]))
    assert v == Violation("/choices/0/message/tool_calls/0/function/arguments", "", "'Paris' is not of type 'object'")
    v = violation(c.CHAT, required, chat(calls=[("get_time", '{"hours": 30}')]))
    assert (v.answer, v.pointer) == ("/choices/0/message/tool_calls/0/function/arguments", "/hours")
    v = violation(c.CHAT, {"tools": [TOOL, TIME], "tool_choice": NAMED}, chat(calls=[("get_time", '{"hours": 1}')]))
    assert (v.answer, v.reason) == ("/choices/0/message/tool_calls/0/function/name", "calls 'get_time', not "
                                                                                      "'get_weather'")
    single = {**required, "parallel_tool_calls": False}
    v = violation(c.CHAT, single, ok)
    assert (v.answer, v.reason) == ("/choices/0/message/tool_calls/1", "a second tool call, though "
                                                                       "parallel_tool_calls is false")
    assert violation(c.CHAT, required, chat("I cannot.")).reason == "no tool call, though tool_choice asked for one"
    # A tool without parameters takes an object (OpenAI: an empty parameter list).
    bare = {"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"}
    assert violation(c.CHAT, bare, chat(calls=[("ping", "{}")])) is None
    assert violation(c.CHAT, bare, chat(calls=[("ping", "3")])).reason == "3 is not of type 'object'"
    # A forced call wins over a response format (vLLM ignores the format then).
    assert expected(c.CHAT, {**required, "response_format": SCHEMA}).tools is not None


def test_a_schema_the_checker_cannot_read_holds_nothing_against_the_answer_and_reasons_are_bounded():
    broken = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}
    assert violation(c.CHAT, broken, chat('{"a": 1}')) is None
    remote = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "https://example.com/schema.json"}}}}
    assert violation(c.CHAT, remote, chat('{"a": 1}')) is None  # never fetched
    v = violation(c.CHAT, {"response_format": SCHEMA}, chat('{"label": "' + "x" * 5000 + '", "score": 0}'))
    assert len(v.reason) <= MAX_REASON and v.pointer == "/label"


def test_the_shard_marks_and_counts_the_structured_answers_cut_short_or_not_following(tmp_path):
    assert cut_short(chat(finish="length")) and not cut_short(chat(finish="tool_calls"))
    assert cut_short({"object": "response", "status": "incomplete"})
    assert not cut_short({"object": "response", "status": "completed"})

    storage = LocalStorage(tmp_path)
    requests = [(cid, {"response_format": SCHEMA}) for cid in ("cut", "whole", "wrong", "bad")]
    lines = [c.success_line("cut", chat('{"label": "posi', finish="length")),
             c.success_line("whole", chat('{"label": "positive", "score": 1}')),
             c.success_line("wrong", chat('{"label": "positive", "score": 2}')),
             c.success_line("free", chat("anything", finish="length")),  # cut, but it asked for no structure
             c.request_error_line("bad", c.INVALID_REQUEST, "no")]
    from batch_dagster.batchfile.structured import expectations

    summary = commit_shard(storage, "r", 0, lines, structured=expectations(c.CHAT, requests))
    assert summary.request_counts == c.RequestCounts(total=5, completed=4, failed=1, incomplete_structured=1,
                                                     invalid_structured=1)
    assert committed_shards(storage, "r")[0].request_counts.invalid_structured == 1
    counts = progress_of(committed_shards(storage, "r"), 5, 1).counts()
    assert counts.to_dict() == {"total": 5, "completed": 4, "failed": 1, "incomplete_structured": 1,
                                "invalid_structured": 1}
    assert "1 not following their schema" in counts.describe()
    # The lines stay as the engine answered them, each marked with its first violation.
    out = {line["custom_id"]: line for line in iter_lines(storage, shard_keys("r", 0)[0])}
    assert out["wrong"][c.INVALID_STRUCTURED] == {"answer": "/choices/0/message/content", "pointer": "/score",
                                                  "reason": "2 is greater than the maximum of 1"}
    assert out["wrong"]["response"]["body"]["choices"][0]["message"]["content"] == '{"label": "positive", "score": 2}'
    assert out["cut"][c.INVALID_STRUCTURED]["reason"].startswith("not JSON")
    assert c.INVALID_STRUCTURED not in out["whole"] and c.INVALID_STRUCTURED not in out["free"]
    assert c.RequestCounts(total=2, completed=2).to_dict() == {"total": 2, "completed": 2, "failed": 0}


@pytest.mark.parametrize("counts", [{"invalid_structured": 3}, {"incomplete_structured": 1, "invalid_structured": 2}])
def test_the_counts_round_trip(counts):
    full = {"total": 9, "completed": 8, "failed": 1, **counts}
    assert c.RequestCounts.from_dict(full).to_dict() == full
