"""Structured answers on the real engine, through both paths (the in-process engine and a vLLM server): every
structured mode's answer parses and follows its schema, forced tool calls their tools' parameters (a tool without
`strict` too: vLLM 0.32 at its default strictness let SmolLM2 answer `"Paris"` for `{"location": ...}`); and an
answer that cannot follow (cut by max_tokens, or a tool schema the grammar does not enforce) is kept, marked and
counted. Each answer is read here with jsonschema itself, not only through the pipeline's own check."""

from __future__ import annotations

import json

import pytest
from jsonschema import validate

from batch_dagster.batchfile import contract as c
from tests.helpers import CHAT_MODEL, answer_text, run_on_real_engine

pytestmark = pytest.mark.engine

REVIEW = "Review: the kettle boils fast and looks great, but the lid broke after a week."
LABEL = {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars", "topics", "product"],
         "properties": {
             "sentiment": {"enum": ["positive", "negative", "mixed"]},
             "stars": {"type": "integer", "minimum": 1, "maximum": 5},
             "topics": {"type": "array", "items": {"enum": ["price", "quality", "looks", "speed"]}, "minItems": 1,
                        "maxItems": 3},
             "product": {"type": "object", "additionalProperties": False, "required": ["name", "broken"],
                         "properties": {"name": {"type": "string", "maxLength": 40}, "broken": {"type": "boolean"}}}}}
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
TIME = {"type": "object", "properties": {"city": {"type": "string"}, "hour": {"type": "integer", "minimum": 0,
                                                                            "maximum": 23}},
        "required": ["city", "hour"]}
# xgrammar leaves `uniqueItems` out of a grammar (vLLM sends such a response format to another backend, but not a
# tool's parameters in a structural tag): three items of two values repeat one, so whatever the constrained call
# holds, it cannot follow this.
UNKEPT = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green"]},
                                                    "minItems": 3, "maxItems": 3, "uniqueItems": True}},
          "required": ["tags"]}


def tool(name: str, parameters: dict, strict: bool | None = None, responses: bool = False) -> dict:
    function = {"name": name, "description": f"The {name.split('_')[1]} of a city", "parameters": parameters,
                **({"strict": strict} if strict is not None else {})}
    return {"type": "function", **function} if responses else {"type": "function", "function": function}


def chat(cid: str, content: str = REVIEW, **fields) -> dict:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 200,
            "temperature": 0, **fields}
    return {"custom_id": cid, "method": "POST", "url": c.CHAT, "body": body}


def response(cid: str, content: str = REVIEW, **fields) -> dict:
    body = {"model": CHAT_MODEL, "input": content, "max_output_tokens": 200, "temperature": 0, **fields}
    return {"custom_id": cid, "method": "POST", "url": c.RESPONSES, "body": body}


ASK = "What's the weather in Paris?"
WEATHER_TOOL, TIME_TOOL = tool("get_weather", WEATHER), tool("get_time", TIME)
NAMED = {"type": "function", "function": {"name": "get_weather"}}
AS_JSON = "Answer in JSON with one key, city: what is the capital of France?"
LABEL_FORMAT = {"name": "label", "schema": LABEL}
CHAT_ROWS = [
    chat("schema-strict", response_format={"type": "json_schema", "json_schema": {**LABEL_FORMAT, "strict": True}}),
    chat("schema", response_format={"type": "json_schema", "json_schema": LABEL_FORMAT}),
    chat("object", AS_JSON, response_format={"type": "json_object"}),
    chat("so-json", structured_outputs={"json": LABEL}),
    chat("so-choice", structured_outputs={"choice": ["positive", "negative", "mixed"]}),
    chat("tool-named", ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=NAMED),  # the request
    chat("tool-named-strict", ASK, tools=[tool("get_weather", WEATHER, strict=True)], tool_choice=NAMED),
    chat("tool-required", ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required"),
    chat("tool-required-one", ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
         parallel_tool_calls=False),
    chat("tool-required-many", ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
         parallel_tool_calls=True),
    # Made to violate: cut by max_tokens, and a tool schema the grammar does not enforce.
    chat("cut", response_format={"type": "json_schema", "json_schema": {**LABEL_FORMAT, "strict": True}},
         max_tokens=5),
    chat("unkept", "Tag this: a red and green flag.", tools=[tool("set_tags", UNKEPT)], tool_choice="required"),
]
RESPONSE_ROWS = [
    response("schema", text={"format": {"type": "json_schema", **LABEL_FORMAT, "strict": True}}),
    response("object", AS_JSON, text={"format": {"type": "json_object"}}),
    response("tool-named", ASK, tools=[tool("get_weather", WEATHER, responses=True)],
             tool_choice={"type": "function", "name": "get_weather"}),
    response("tool-required", ASK, tools=[tool("get_weather", WEATHER, responses=True),
                                          tool("get_time", TIME, responses=True)], tool_choice="required"),
]
COMPLETION_ROWS = [{"custom_id": "schema", "method": "POST", "url": c.COMPLETIONS, "body": {
    "model": CHAT_MODEL, "prompt": REVIEW + "\nLabel as JSON:", "max_tokens": 200, "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": LABEL_FORMAT}}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME, "set_tags": UNKEPT}


def follows(text: str, schema: dict) -> None:
    validate(json.loads(text), schema)


def calls_of(body: dict) -> list[tuple[str, str]]:
    if body.get("object") == "response":
        return [(item["name"], item["arguments"]) for item in body["output"] if item["type"] == "function_call"]
    return [(call["function"]["name"], call["function"]["arguments"])
            for call in body["choices"][0]["message"].get("tool_calls") or ()]


@pytest.fixture(scope="module")
def paths(tmp_path_factory, vllm_server):
    """Each file through the in-process engine and through the session's vLLM server: {path: {file: (summary,
    output lines, error lines)}}."""
    from tests.helpers import dagster_instance

    runs: dict[str, dict[str, tuple]] = {}
    for path, engine in (("in-process", {}), ("server", {"mode": "server", "server_urls": [vllm_server]})):
        for name, rows in (("chat", CHAT_ROWS), ("responses", RESPONSE_ROWS), ("completions", COMPLETION_ROWS)):
            work = tmp_path_factory.mktemp(f"{path}-{name}")
            with dagster_instance() as instance:
                runs.setdefault(path, {})[name] = run_on_real_engine(work, work / "data", instance, rows, **engine)
    return runs


@pytest.mark.parametrize("path", ["in-process", "server"])
def test_every_structured_answer_follows_its_schema_on_both_paths(paths, path):
    for name, rows in (("chat", CHAT_ROWS), ("responses", RESPONSE_ROWS), ("completions", COMPLETION_ROWS)):
        summary, out, err = paths[path][name]
        assert err == {}, {cid: e["response"]["body"] for cid, e in err.items()}
        assert set(out) == {r["custom_id"] for r in rows}
        bodies = {cid: line["response"]["body"] for cid, line in out.items() if cid not in ("cut", "unkept")}
        for cid, body in bodies.items():
            assert c.INVALID_STRUCTURED not in out[cid], (name, cid, out[cid][c.INVALID_STRUCTURED])
            if cid.startswith("tool-"):
                calls = calls_of(body)
                assert calls, (name, cid, body)
                for called, arguments in calls:  # each call's arguments: a JSON object following its parameters
                    follows(arguments, PARAMETERS[called])
                if "named" in cid:
                    assert {called for called, _ in calls} == {"get_weather"}, (name, cid, calls)
                if cid == "tool-required-one":
                    assert len(calls) == 1
            elif cid == "so-choice":
                assert answer_text(body) in ("positive", "negative", "mixed")
            elif cid == "object":
                assert isinstance(json.loads(answer_text(body)), dict), answer_text(body)
            else:
                follows(answer_text(body), LABEL)
    # The request, read whole: a get_weather call for Paris, its arguments an object.
    [(called, arguments)] = calls_of(paths[path]["chat"][1]["tool-named"]["response"]["body"])
    assert called == "get_weather" and json.loads(arguments) == {"location": "Paris"}, arguments
    assert "invalid_structured" not in paths[path]["responses"][0]["request_counts"]
    assert "invalid_structured" not in paths[path]["completions"][0]["request_counts"]


@pytest.mark.parametrize("path", ["in-process", "server"])
def test_an_answer_that_cannot_follow_is_kept_marked_and_counted(paths, path):
    summary, out, _ = paths[path]["chat"]
    assert summary["request_counts"] == {"total": len(CHAT_ROWS), "completed": len(CHAT_ROWS), "failed": 0,
                                         "incomplete_structured": 1, "invalid_structured": 1}
    cut = out["cut"]
    assert cut["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert cut[c.INVALID_STRUCTURED]["answer"] == "/choices/0/message/content"
    assert cut[c.INVALID_STRUCTURED]["reason"].startswith("not JSON: ")
    unkept = out["unkept"]
    [(called, arguments)] = calls_of(unkept["response"]["body"])  # kept as the engine answered it
    tags = json.loads(arguments)["tags"]
    assert called == "set_tags" and len(tags) == 3 and set(tags) <= {"red", "green"}  # the grammar kept the rest
    assert unkept[c.INVALID_STRUCTURED] == {"answer": "/choices/0/message/tool_calls/0/function/arguments",
                                            "pointer": "/tags", "reason": f"{tags!r} has non-unique elements"}


def test_both_paths_mark_and_count_alike(paths):
    """The same lines marked, for the same reasons (in bfloat16 the answers' text may differ between the paths: how
    requests are batched changes the sums; test_parity.py compares lines in float32)."""
    for name in ("chat", "responses", "completions"):
        one, other = paths["in-process"][name], paths["server"][name]
        assert one[0]["request_counts"] == other[0]["request_counts"], name
        marked = [{cid: (line[c.INVALID_STRUCTURED]["answer"], line[c.INVALID_STRUCTURED]["pointer"])
                   for cid, line in run[1].items() if c.INVALID_STRUCTURED in line} for run in (one, other)]
        assert marked[0] == marked[1], name
