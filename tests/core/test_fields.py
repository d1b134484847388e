"""The field matrix: every refused field is refused at validation, at its line and param, with why; every honored
one is typed; docs/formats.md's tables are generated from it. (That it names every field of the openai SDK and of
vLLM's request models: tests/pipeline/test_field_matrix.py, which may import them.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import field_docs
from batch_dagster.batchfile.bodies import _plain
from batch_dagster.batchfile.fields import FIELDS, PARTS, Serves, counts
from batch_dagster.batchfile.schema import PROMPT, TYPED
from batch_dagster.batchfile.validate import validate_file

REPO = Path(__file__).resolve().parents[2]
MODEL = "m"
TEXT_MODEL = Serves((c.CHAT, c.COMPLETIONS, c.RESPONSES))  # no tool-call or reasoning parser, no images
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def body(url: str, **fields) -> dict:
    prompt = {c.CHAT: {"messages": [{"role": "user", "content": "hi"}]}, c.COMPLETIONS: {"prompt": "hi"},
              c.EMBEDDINGS: {"input": "hi"}, c.RESPONSES: {"input": "hi"},
              c.SCORE: {"queries": "hi", "documents": ["a", "b"]}, c.RERANK: {"query": "hi", "documents": ["a"]}}[url]
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


REFUSED = [(url, name) for url, table in FIELDS.items() for name, f in table.items() if not f.honored]


@pytest.mark.parametrize(("url", "name"), REFUSED, ids=[f"{u.rsplit('/', 1)[1]}-{n}" for u, n in REFUSED])
def test_every_refused_field_is_refused_at_its_line_and_param_with_why(tmp_path, url, name):
    [(line, param, message)] = rejected(tmp_path, url, {name: 1})
    assert (line, param) == (2, f"body.{name}")
    assert message == f"Field 'body.{name}' is refused: {FIELDS[url][name].note}."


# Honored fields refused for some values or models: a value that is refused on TEXT_MODEL, and the param.
CONDITIONAL = [
    (c.CHAT, {"stream": True}, "body.stream"),
    (c.CHAT, {"store": True}, "body.store"),
    (c.CHAT, {"modalities": ["text", "audio"]}, "body.modalities"),
    (c.CHAT, {"service_tier": "flex"}, "body.service_tier"),
    (c.CHAT, {"tools": [TOOL]}, "body.tools"),  # tool_choice defaults to "auto" with tools, as at OpenAI
    (c.CHAT, {"tool_choice": "auto"}, "body.tool_choice"),
    (c.CHAT, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "body.tool_choice"),
    (c.CHAT, {"reasoning_effort": "low"}, "body.reasoning_effort"),
    (c.CHAT, {"include_reasoning": False}, "body.include_reasoning"),
    (c.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, IMAGE]}]},
     "body.messages[0].content[1]"),
    (c.CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "body.messages[0].content[0]"),
    (c.COMPLETIONS, {"stream": True}, "body.stream"),
    (c.RESPONSES, {"stream": True}, "body.stream"),
    (c.RESPONSES, {"store": True}, "body.store"),
    (c.RESPONSES, {"service_tier": "priority"}, "body.service_tier"),
    (c.RESPONSES, {"include": ["reasoning.encrypted_content"]}, "body.include"),
    (c.RESPONSES, {"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}, "body.tools"),
    (c.RESPONSES, {"reasoning": {"effort": "low"}}, "body.reasoning"),
    (c.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}]},
     "body.input[0].content[0]"),
]


@pytest.mark.parametrize(("url", "fields", "param"), CONDITIONAL)
def test_honored_fields_are_refused_where_the_value_or_the_model_asks_for_more(tmp_path, url, fields, param):
    [(line, got, message)] = rejected(tmp_path, url, fields)
    assert (line, got) == (2, param) and "is refused: " in message


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


def test_honored_fields_are_the_typed_ones_and_the_fast_path_takes_only_those():
    for url, table in FIELDS.items():
        assert {name for name, f in table.items() if f.honored} == TYPED[url], url
        for name in set(table) - {PROMPT[url]}:
            assert not _plain(url, body(url, **{name: 1})) or table[name].honored


def test_the_field_tables_of_the_docs_are_generated_from_the_matrix():
    doc = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    assert field_docs.BEGIN in doc and field_docs.END in doc
    assert field_docs.with_tables(doc) == doc, "run: python -m batch_dagster.batchfile.field_docs --update docs/formats.md"
    for url, (honored, refused) in counts().items():
        assert f"(`{url}`): {honored} honored, {refused} refused" in doc
    assert all(f"| `{kind}` |" in doc for kind in PARTS)
