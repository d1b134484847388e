"""The body schema of validation: every documented field in its types and ranges, `param` naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch_dagster.batchfile import bodies as b
from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.bodies import SCHEMAS

TYPED_ENDPOINTS = tuple(SCHEMAS)

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def error_of(url: str, body: dict) -> tuple[str, str] | None:
    try:
        b.check_body(url, body)
    except b.BodyError as exc:
        return exc.param, str(exc)
    return None


def test_every_documented_field_takes_its_valid_values():
    chat = {"model": MODEL, "messages": [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "calc", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1", "name": "calc"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
    ], "max_tokens": 5, "max_completion_tokens": 5, "temperature": 2, "top_p": 1, "n": 128, "stop": ["a", "b"],
        "seed": -(2**63), "presence_penalty": -2, "frequency_penalty": 2.0, "logprobs": True, "top_logprobs": 20,
        "top_k": -1, "min_p": 0, "repetition_penalty": 1.1, "min_tokens": 0, "ignore_eos": False,
        "enable_thinking": False, "chat_template_kwargs": {"x": [1]}, "logit_bias": {"5": -100},
        "response_format": {"type": "json_object"}, "user": "u", "stream": False, "store": False,
        "tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "calc"}}, "structured_outputs": {"regex": "[0-9]+"},
        "stop_token_ids": [2], "allowed_token_ids": [1, 2], "truncate_prompt_tokens": 5, "documents": [{"t": "x"}]}
    assert error_of(c.CHAT, chat) is None
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1], [2, 3]], ""):
        assert error_of(c.COMPLETIONS, {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 5, "stop": "x"}) is None
    for value in ("text", ["a"], [0, b.MAX_TOKEN_ID], [[7]]):
        assert error_of(c.EMBEDDINGS, {"model": MODEL, "input": value, "encoding_format": "base64",
                                       "embed_dtype": "float16", "endianness": "big"}) is None


@pytest.mark.parametrize(("url", "fields", "param"), [
    (c.CHAT, {"temperature": "hot"}, "body.temperature"),
    (c.CHAT, {"temperature": 2.5}, "body.temperature"),
    (c.CHAT, {"temperature": True}, "body.temperature"),
    (c.CHAT, {"top_p": [1]}, "body.top_p"),
    (c.CHAT, {"stop": 5}, "body.stop"),
    (c.CHAT, {"stop": ["a", 5]}, "body.stop[1]"),
    (c.CHAT, {"max_tokens": 0}, "body.max_tokens"),
    (c.CHAT, {"max_tokens": 8.0}, "body.max_tokens"),
    (c.CHAT, {"n": 129}, "body.n"),
    (c.CHAT, {"seed": 2**64}, "body.seed"),
    (c.CHAT, {"presence_penalty": "a"}, "body.presence_penalty"),
    (c.CHAT, {"frequency_penalty": -3}, "body.frequency_penalty"),
    (c.CHAT, {"chat_template_kwargs": "xy"}, "body.chat_template_kwargs"),
    (c.CHAT, {"enable_thinking": "no"}, "body.enable_thinking"),
    (c.CHAT, {"top_k": 1.5}, "body.top_k"),
    (c.CHAT, {"repetition_penalty": 0}, "body.repetition_penalty"),
    (c.CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "body.messages[0].role"),
    (c.CHAT, {"messages": [{"content": "x"}]}, "body.messages[0].role"),
    (c.CHAT, {"messages": [{"role": "user", "content": 5}]}, "body.messages[0].content"),
    (c.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "body.messages[0].content[0].text"),
    (c.CHAT, {"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "body.messages[0].content[0].type"),
    (c.CHAT, {"messages": [{"role": "user", "content": "x", "deep": [[[[[[[[[]]]]]]]]] * 1}]}, None),
    (c.COMPLETIONS, {"prompt": [1, "a"]}, "body.prompt"),
    (c.COMPLETIONS, {"prompt": []}, "body.prompt"),
    (c.COMPLETIONS, {"prompt": [-1]}, "body.prompt"),
    (c.COMPLETIONS, {"prompt": [2**40]}, "body.prompt"),
    (c.COMPLETIONS, {"prompt": "x", "logprobs": 6}, "body.logprobs"),
    (c.EMBEDDINGS, {"input": "x", "encoding_format": "int8"}, "body.encoding_format"),
    (c.EMBEDDINGS, {"input": {"a": 1}}, "body.input"),
])
def test_wrong_types_and_ranges_name_the_field(url, fields, param):
    body = {"model": MODEL, **({"messages": MESSAGES} if url == c.CHAT else {}), **fields}
    if url == c.COMPLETIONS:
        body.setdefault("prompt", "x")
    err = error_of(url, body)
    if param is None:  # shallow enough: passes
        assert err is None
    else:
        assert err is not None and err[0] == param, err
        assert param in err[1]


def deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


def test_max_depth_counts_levels_of_the_body():
    # body (1) > field (2) > ... : a field value of MAX_DEPTH - 1 levels is the deepest allowed.
    # body (1) > chat_template_kwargs (2) > "x" (3) > ...
    assert error_of(c.CHAT, {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {
        "x": deep(b.MAX_DEPTH - 2)}}) is None
    assert error_of(c.CHAT, {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {
        "x": deep(b.MAX_DEPTH - 1)}})[0] == "body.chat_template_kwargs"
    # Depth first, even for a field the matrix refuses: a body too deep to store must fail the file.
    too_deep = error_of(c.CHAT, {"model": MODEL, "messages": MESSAGES, "x": deep(b.MAX_DEPTH)})
    assert too_deep[0] == "body.x" and "nested deeper" in too_deep[1]
    part = {"type": "image_url", "image_url": {"url": deep(b.MAX_DEPTH)}}
    err = error_of(c.CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [part]}]})
    assert err is not None and err[0] == "body.messages[0]" and "nested deeper" in err[1]


def plain_body(url: str, **fields) -> dict:
    text = {"messages": [{"role": "user", "content": "x"}]} if url == c.CHAT else {
        "prompt" if url == c.COMPLETIONS else "input": "x"}
    return {"model": MODEL, **text, **fields}


def accepts(url: str, body: dict) -> bool:
    try:
        msgspec.convert(body, b.SCHEMAS[url])
    except msgspec.ValidationError:
        return False
    return True


PROBES = [None, True, False, "1", [], ["a"], [1], {}, 2**64, -(2**64), 1e300, -1e300]


def test_the_fast_path_never_accepts_what_the_schema_refuses():
    # Every field the fast path knows, at and around each bound it uses, as int and float, and odd values.
    checked = 0
    for key, (_, low, high) in b._PLAIN_SCALARS.items():
        around = [x + d for x in (low, high) for d in (-1, -0.5, 0, 0.5, 1)]
        for value in [*around, *(int(x) for x in around), *(float(x) for x in around), *PROBES]:
            for url in TYPED_ENDPOINTS:
                body = plain_body(url, **{key: value})
                if b._plain(url, body):
                    checked += 1
                    assert accepts(url, body), (url, key, value)
    for key in [*b._PLAIN_SWITCHES, "stop"]:
        for value in [*PROBES, "", ["a", 1], 0, 1]:
            for url in TYPED_ENDPOINTS:
                body = plain_body(url, **{key: value})
                if b._plain(url, body):
                    checked += 1
                    assert accepts(url, body), (url, key, value)
    assert checked > 300


@settings(max_examples=300, deadline=None)
@given(url=st.sampled_from(TYPED_ENDPOINTS),
       fields=st.dictionaries(st.sampled_from(sorted([*b._PLAIN_SCALARS, *b._PLAIN_SWITCHES, "stop", "logprobs"])),
                              st.none() | st.booleans() | st.integers(-3, 130) | st.floats(-3, 3) | st.text(max_size=2)
                              | st.lists(st.text(max_size=2) | st.integers(), max_size=2), max_size=4),
       messages=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot", 5]),
                                                "content": st.sampled_from(["x", 5, None])}), min_size=1, max_size=2))
def test_fast_path_combinations_agree_with_the_schema(url, fields, messages):
    body = {**plain_body(url, **fields), **({"messages": messages} if url == c.CHAT else {})}
    if b._plain(url, body):
        assert accepts(url, body)


def test_validate_lists_mistyped_requests_that_will_end_as_400_lines(tmp_path):
    rows = [{"custom_id": cid, "method": "POST", "url": c.CHAT, "body": {"model": MODEL, "messages": MESSAGES, **f}}
            for cid, f in (("ok", {}), ("hot", {"temperature": "hot"}), ("stop", {"stop": [1]}))]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = str(Path(sys.executable).with_name("batch-dagster"))
    proc = subprocess.run([cli, "validate", str(path), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["valid"] and report["rejected_count"] == 2
    assert [(e["line"], e["param"], e["code"]) for e in report["rejected"]] == [
        (2, "body.temperature", "invalid_request"), (3, "body.stop[0]", "invalid_request")]
    assert "expected `number`, got `string`" in report["rejected"][0]["message"]
    text = subprocess.run([cli, "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "line 2 (body.temperature)" in text.stderr


@pytest.mark.parametrize("key", ["chat_template", "tokenize"])
@pytest.mark.parametrize("url", [c.CHAT, c.RESPONSES])
def test_a_clients_own_template_in_the_template_kwargs_is_refused_at_its_line(url, key):
    """vLLM refuses these keys (resolve_chat_template_kwargs): a client's template would run in the count and in the
    engine's renderer. Refused here, the line is a 400 before anything renders it."""
    prompt = {"messages": MESSAGES} if url == c.CHAT else {"input": "hi"}
    body = {"model": MODEL, **prompt, "chat_template_kwargs": {key: "{% for i in range(10**9) %}x{% endfor %}"}}
    err = error_of(url, body)
    assert err is not None and err[0] == "body.chat_template_kwargs" and repr(key) in err[1]
    assert error_of(url, {**body, "chat_template_kwargs": {"add_generation_prompt": True, "x": 1}}) is None


@pytest.mark.parametrize(("url", "field"), [(c.SCORE, "documents"), (c.SCORE, "queries"), (c.RERANK, "documents")])
def test_a_score_or_rerank_line_holds_a_bounded_number_of_texts(url, field):
    texts = {"documents": "d", "queries": "q"} if url == c.SCORE else {"documents": "d", "query": "q"}
    at_most = {"model": MODEL, **texts, field: ["t"] * c.MAX_SCORE_TEXTS}
    assert error_of(url, at_most) is None
    err = error_of(url, {**at_most, field: ["t"] * (c.MAX_SCORE_TEXTS + 1)})
    assert err is not None and err[0] == f"body.{field}" and f"{c.MAX_SCORE_TEXTS}" in err[1]
