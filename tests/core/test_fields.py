"""The field matrix: every refused field is refused at validation, at its line and param, with why; every accepted
one (honored, or accepted with no effect here) is typed, and the no-ops vLLM would refuse are left out of the body it
gets; docs/formats.md's tables are generated from it. (That it names every field of the openai SDK and of vLLM's
request models: tests/pipeline/test_field_matrix.py, which may import them.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import field_docs
from batch_dagster.batchfile.bodies import _plain
from batch_dagster.batchfile.fields import FIELDS, NO_EFFECT, PARTS, REFUSED, Serves, for_engine
from batch_dagster.batchfile.schema import PROMPT, TYPED
from batch_dagster.batchfile.validate import validate_file

REPO = Path(__file__).resolve().parents[2]
MODEL = "m"
TEXT_MODEL = Serves((c.CHAT, c.COMPLETIONS, c.RESPONSES, c.MESSAGES))  # no tool-call or reasoning parser, no images
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def body(url: str, **fields) -> dict:
    prompt = {c.CHAT: {"messages": [{"role": "user", "content": "hi"}]}, c.COMPLETIONS: {"prompt": "hi"},
              c.EMBEDDINGS: {"input": "hi"}, c.RESPONSES: {"input": "hi"},
              c.SCORE: {"queries": "hi", "documents": ["a", "b"]}, c.RERANK: {"query": "hi", "documents": ["a"]},
              c.MESSAGES: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}}[url]
    return {"model": MODEL, **prompt, **fields}


def rejected(tmp_path: Path, url: str, fields: dict, serves: Serves = TEXT_MODEL) -> list[tuple[int, str, str]]:
    """Validate a file whose line 2 carries `fields`: its rejections as (line, param, message)."""
    rows = [{"custom_id": str(i), "method": "POST", "url": url, "body": body(url, **f)} for i, f in enumerate(
        [{}, fields])]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    embeds = (c.EMBEDDINGS, c.SCORE, c.RERANK)
    report = validate_file(path, models={MODEL: serves if url not in embeds else Serves(embeds)})
    assert report.valid, report.errors
    return [(e.line, e.param, e.message) for e in report.rejected]


REFUSALS = [(url, name) for url, table in FIELDS.items() for name, f in table.items() if f.kind == REFUSED]


@pytest.mark.parametrize(("url", "name"), REFUSALS, ids=[f"{u.rsplit('/', 1)[1]}-{n}" for u, n in REFUSALS])
def test_every_refused_field_is_refused_at_its_line_and_param_with_why(tmp_path, url, name):
    [(line, param, message)] = rejected(tmp_path, url, {name: 1})
    assert (line, param) == (2, f"body.{name}")
    assert message == f"Field 'body.{name}' is refused: {FIELDS[url][name].note}."


# Accepted fields refused for some values or models: a value that is refused on TEXT_MODEL, and the param.
CONDITIONAL = [
    (c.CHAT, {"stream": True}, "body.stream"),
    (c.CHAT, {"modalities": ["text", "audio"]}, "body.modalities"),
    (c.CHAT, {"watermarking": True}, "body.watermarking"),
    (c.CHAT, {"tools": [TOOL]}, "body.tools"),  # tool_choice defaults to "auto" with tools, as at OpenAI
    (c.CHAT, {"tool_choice": "auto"}, "body.tool_choice"),
    (c.CHAT, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "body.tool_choice"),
    (c.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, IMAGE]}]},
     "body.messages[0].content[1]"),
    (c.CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "body.messages[0].content[0]"),
    (c.COMPLETIONS, {"stream": True}, "body.stream"),
    (c.COMPLETIONS, {"best_of": 3, "n": 2}, "body.best_of"),
    (c.RESPONSES, {"stream": True}, "body.stream"),
    (c.RESPONSES, {"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}, "body.tools"),
    (c.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}]},
     "body.input[0].content[0]"),
    (c.MESSAGES, {"stream": True}, "body.stream"),
    (c.MESSAGES, {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}, "body.thinking"),
    (c.MESSAGES, {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "body.tools"),
    (c.MESSAGES, {"tool_choice": {"type": "any"}}, "body.tool_choice"),
    (c.MESSAGES, {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "body.messages[0].content[0]"),
    (c.MESSAGES, {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "body.messages[0].content[0]"),
]


@pytest.mark.parametrize(("url", "fields", "param"), CONDITIONAL)
def test_honored_fields_are_refused_where_the_value_or_the_model_asks_for_more(tmp_path, url, fields, param):
    [(line, got, message)] = rejected(tmp_path, url, fields)
    assert (line, got) == (2, param) and "is refused: " in message


# What clients send on every line whatever the model (inspect_ai's Responses lines carry the first two; the rest are
# OpenAI's request fields that change no answer here), and the reasoning fields vLLM takes on any model: accepted on a
# model without a reasoning parser. Main refused each of these (the `include` refusal failed inspect_ai's whole eval).
CLIENTS_NO_OPS = [
    (c.RESPONSES, {"include": ["reasoning.encrypted_content"], "store": False}),
    (c.RESPONSES, {"include": ["reasoning.encrypted_content", "web_search_call.action.sources",
                               "message.output_text.logprobs"], "top_logprobs": 2}),
    (c.RESPONSES, {"store": True, "service_tier": "flex", "background": True, "prompt_cache_key": "k",
                   "safety_identifier": "s", "prompt_cache_retention": "24h", "max_tool_calls": 3}),
    (c.RESPONSES, {"reasoning": {"effort": "low"}, "include_reasoning": False}),
    (c.CHAT, {"store": True, "metadata": {"team": "evals"}, "service_tier": "priority", "prompt_cache_key": "k",
              "safety_identifier": "s", "prompt_cache_options": {"ttl": "30m"}, "user": "u",
              "verbosity": "low", "prediction": {"type": "content", "content": "Paris"}}),
    (c.CHAT, {"reasoning_effort": "low", "include_reasoning": False, "modalities": ["text"], "watermarking": False}),
    (c.COMPLETIONS, {"best_of": 1, "priority": 5, "spaces_between_special_tokens": False}),
    (c.EMBEDDINGS, {"user": "u", "priority": -1}),
]


@pytest.mark.parametrize(("url", "fields"), CLIENTS_NO_OPS)
def test_what_clients_send_that_changes_nothing_here_is_accepted(tmp_path, url, fields):
    assert rejected(tmp_path, url, fields) == []


def test_the_no_ops_vllm_would_refuse_are_left_out_of_the_body_it_gets():
    given = body(c.RESPONSES, include=["web_search_call.results", "reasoning.encrypted_content"], store=False,
                 service_tier="ultrafast", background=True, priority=3, kv_transfer_params={"do_remote_prefill": True},
                 user="u", metadata={"a": "b"})
    sent = for_engine(c.RESPONSES, given)
    assert sent == {"model": MODEL, "input": "hi", "include": ["reasoning.encrypted_content"], "store": False,
                    "user": "u", "metadata": {"a": "b"}}
    assert given["service_tier"] == "ultrafast"  # the stored body is untouched
    assert "include" not in for_engine(c.RESPONSES, body(c.RESPONSES, include=["web_search_call.results"]))
    plain = body(c.CHAT, temperature=0, store=False, prompt_cache_key="k")
    assert for_engine(c.CHAT, plain) is plain  # nothing to leave out: the same body, not a copy
    for url, table in FIELDS.items():  # the table's words say which are left out
        for name, f in table.items():
            assert ("left out" in f.note) == f.left_out or name == "include", (url, name)


def test_an_accepted_no_op_is_typed_and_bounded_like_any_field(tmp_path):
    too_many = {f"k{i}": "v" for i in range(17)}
    for url, fields, param in [(c.CHAT, {"store": "yes"}, "body.store"),
                               (c.CHAT, {"metadata": too_many}, "body.metadata"),
                               (c.CHAT, {"metadata": {"k": "v" * 513}}, "body.metadata[...]"),
                               (c.RESPONSES, {"include": ["reasoning.everything"]}, "body.include[0]"),
                               (c.RESPONSES, {"max_tool_calls": -1}, "body.max_tool_calls"),
                               (c.CHAT, {"prompt_cache_retention": "forever"}, "body.prompt_cache_retention")]:
        [(line, got, message)] = rejected(tmp_path, url, fields)
        assert (line, got) == (2, param), (fields, got, message)
        assert "is refused" not in message  # a type or range error, not a refusal


def test_what_a_model_takes_is_what_its_registry_entry_says(tmp_path):
    tools = Serves((c.CHAT, c.RESPONSES), tool_calls=True, reasoning=True, images=1)
    assert rejected(tmp_path, c.CHAT, {"tools": [TOOL], "tool_choice": "auto", "reasoning_effort": "low"}, tools) == []
    assert rejected(tmp_path, c.CHAT, {"tools": [TOOL], "tool_choice": "none"}) == []  # rendered, never called
    one = [{"role": "user", "content": [{"type": "text", "text": "compare"}, IMAGE]}]
    assert rejected(tmp_path, c.CHAT, {"messages": one}, tools) == []
    [(_, param, message)] = rejected(tmp_path, c.CHAT, {"messages": [{"role": "user", "content": [IMAGE, IMAGE]}]},
                                     tools)
    assert param == "body.messages[0].content[1]" and "at most 1 image(s)" in message
    [(_, param, message)] = rejected(tmp_path, c.CHAT, {"temprature": 0})
    assert param == "body.temprature" and "not a request field of /v1/chat/completions" in message
    assert rejected(tmp_path, c.CHAT, {"stream": False, "store": False, "modalities": ["text"], "functions": None}) == []


def test_a_forced_tool_call_is_refused_where_the_models_parser_cannot_make_it_follow_the_tools_parameters(tmp_path):
    from batch_dagster.batchfile.registry import ModelSpec

    free = ModelSpec(name=MODEL, source="/m", tool_call_parser="gemma4").serves  # forced choice runs as `auto`
    named = {"type": "function", "function": {"name": "get_weather"}}
    for url, tool in ((c.CHAT, TOOL), (c.RESPONSES, {"type": "function", "name": "get_weather"})):
        for choice in ("required", named if url == c.CHAT else {"type": "function", "name": "get_weather"}):
            [(line, param, message)] = rejected(tmp_path, url, {"tools": [tool], "tool_choice": choice}, free)
            assert (line, param) == (2, "body.tool_choice"), message
            assert "gemma4 tool-call parser as `auto`" in message and "arguments could be free text" in message
        assert rejected(tmp_path, url, {"tools": [tool], "tool_choice": "auto"}, free) == []
        assert rejected(tmp_path, url, {"tools": [tool]}, free) == []
    hermes = ModelSpec(name=MODEL, source="/m", tool_call_parser="hermes").serves  # its structural tag pins them
    assert hermes.forced_tools_refused is None
    assert rejected(tmp_path, c.CHAT, {"tools": [TOOL], "tool_choice": "required"}, hermes) == []
    assert rejected(tmp_path, c.CHAT, {"tools": [TOOL], "tool_choice": named}, hermes) == []


def test_accepted_fields_are_the_typed_ones_and_the_fast_path_takes_only_those():
    for url, table in FIELDS.items():
        assert {name for name, f in table.items() if f.accepted} == TYPED[url], url
        for name in set(table) - {PROMPT[url]}:
            assert not _plain(url, body(url, **{name: 1})) or (table[name].accepted and table[name].refuse is None
                                                                and table[name].to_engine is None)


def test_the_field_tables_of_the_docs_are_generated_from_the_matrix():
    doc = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    assert field_docs.BEGIN in doc and field_docs.END in doc
    assert field_docs.with_tables(doc) == doc, "run: python -m batch_dagster.batchfile.field_docs --update docs/formats.md"
    for url, table in FIELDS.items():
        assert field_docs.heading(url) in doc
        for name, f in table.items():
            assert f"| `{name}` | {f.kind} |" in doc, (url, name)
    assert sum(f.kind == NO_EFFECT for t in FIELDS.values() for f in t.values()) >= 40  # the third state is listed
    assert all(f"| `{kind}` |" in doc for kind in PARTS)
