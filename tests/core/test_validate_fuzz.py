"""A hypothesis fuzz of the validator: it never raises, and whatever it accepts the pipeline's core can
store, shard and read back, every custom_id once (issue #13, defect 4)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.bodies import SCHEMAS, TYPED
from batch_dagster.batchfile.columnar import read_shard, validate_to_parquet, write_shards
from batch_dagster.batchfile.validate import validate_stream
from batch_dagster.engine.lines import RequestError, check

TYPED_ENDPOINTS = tuple(SCHEMAS)

MODEL = "smollm2-135m-instruct"
MAX_DEPTH = 64  # docs/formats.md
# The fields each endpoint types (the field matrix's honored ones); refused and unknown ones come as "unknown".
FIELDS = {url: sorted(TYPED[url] - {"model"}) for url in SCHEMAS}
KNOWN_CODES = {v for k, v in vars(c).items() if k.isupper() and isinstance(v, str) and not v.startswith("/")}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any JSON value, big integers (past 64 bits) and lone surrogates in strings included.
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2, max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.sampled_from(["\ud800", "a\udc00"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)


def nested(depth: int) -> object:
    value: object = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def base_body(endpoint: str, i: int) -> dict:
    if endpoint == c.CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}]}
    if endpoint == c.COMPLETIONS:
        return {"model": MODEL, "prompt": f"Once {i}"}
    return {"model": MODEL, "input": f"text {i}"}


def _messages(body: dict) -> bool:
    """Whether an earlier mutation left `messages` a non-empty list to mutate further."""
    return isinstance(body.get("messages"), list) and bool(body["messages"])


@st.composite
def bodies(draw, endpoint: str, i: int) -> dict:
    """A valid body with up to three mutations: a field of the schema or an unknown one set to any value,
    deep nesting, content parts."""
    body = base_body(endpoint, i)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["field", "unknown", "deep", "parts", "message"]))
        if kind == "field":
            body[draw(st.sampled_from(sorted(FIELDS[endpoint])))] = draw(json_values)
        elif kind == "unknown":
            body[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
        elif kind == "deep":
            body[draw(st.sampled_from(["extra", "chat_template_kwargs", "metadata"]))] = nested(
                draw(st.integers(MAX_DEPTH - 3, 300)))
        elif kind == "parts" and endpoint == c.CHAT and _messages(body) and isinstance(body["messages"][-1], dict):
            body["messages"][-1]["content"] = draw(st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "other"])},
                                      optional={"text": json_values, "image_url": json_values}), max_size=3))
        elif kind == "message" and endpoint == c.CHAT and _messages(body):
            body["messages"].append(draw(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]),
                                                         json_values, max_size=4)))
    return body


def line_bytes(request: dict) -> bytes:
    # ensure_ascii keeps lone surrogates as "\ud800" escapes, as a careless client writes them.
    return json.dumps(request).encode()


RAW_MUTATIONS = [
    lambda b: b"\xef\xbb\xbf" + b,  # a BOM in front of a line that is not the first
    lambda b: b.replace(b'"hello', b'"\\ud800hello', 1),  # a lone surrogate escape
    lambda b: b.replace(b'{"model"', b'{"temperature": NaN, "model"', 1),
    lambda b: b.replace(b'{"model"', b'{"temperature": Infinity, "model"', 1),
    lambda b: b.replace(b'{"model"', b'{"seed": 123456789012345678901234567890, "model"', 1),
    lambda b: b.replace(b'{"model"', b'{"max_tokens": 1e400, "model"', 1),
    lambda b: b.replace(b'{"custom_id"', b'{"custom_id": "dup", "custom_id"', 1),  # duplicate keys
    lambda b: b.replace(b'{"model"', b'{"model": 5, "model"', 1),
    lambda b: b[: len(b) // 2],
    lambda b: b.replace(b'"', b"", 1),
    lambda b: b + b"\r",
    lambda b: b"[" * 300 + b + b"]" * 300,
]


@st.composite
def files(draw) -> bytes:
    endpoint = draw(st.sampled_from(TYPED_ENDPOINTS))
    lines = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["good", "body", "raw", "bytes"]))
        body = draw(bodies(endpoint, i)) if kind != "good" else base_body(endpoint, i)
        raw = line_bytes({"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": body})
        if kind == "raw":
            raw = draw(st.sampled_from(RAW_MUTATIONS))(raw)
        elif kind == "bytes":  # random bytes spliced in
            at = draw(st.integers(0, len(raw)))
            raw = raw[:at] + draw(st.binary(max_size=6)) + raw[at:]
        lines.append(raw)
    return b"\n".join(lines) + draw(st.sampled_from([b"", b"\n", b"\r\n"]))


def check_agreement(data: bytes, tmp: Path) -> None:
    accepted: list[str] = []
    report = validate_stream(io.BytesIO(data), on_request=lambda line, r: accepted.append(r["custom_id"]))
    assert {e.code for e in report.errors} <= KNOWN_CODES
    assert all(e.line is not None for e in report.errors if e.code == c.INVALID_REQUEST)
    if not report.valid:
        return
    path = tmp / "in.jsonl"
    path.write_bytes(data)
    requests = tmp / "requests.parquet"
    assert validate_to_parquet(path, requests).valid
    write_shards(requests, tmp / "shards", shard_size=2)
    ids = [cid for shard in sorted((tmp / "shards").iterdir()) for cid, _ in read_shard(shard)]
    assert sorted(ids) == sorted(accepted) and len(set(ids)) == len(ids)


@FUZZ
@given(data=files())
def test_validator_never_raises_and_agrees_with_the_pipeline(tmp_path_factory, data):
    check_agreement(data, tmp_path_factory.mktemp("fuzz"))


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_never_raise(tmp_path_factory, data):
    check_agreement(data, tmp_path_factory.mktemp("fuzz"))


# Regression tests: each of these lines passed validation on main and then failed the whole batch.

def line(body: dict, custom_id: str = "a") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": c.CHAT, "body": body}


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(("body", "param"), [
    (chat_body(temperature="hot"), "body.temperature"),
    (chat_body(stop=5), "body.stop"),
    (chat_body(top_p=[1]), "body.top_p"),
    (chat_body(presence_penalty="a"), "body.presence_penalty"),
    (chat_body(chat_template_kwargs="xy"), "body.chat_template_kwargs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "body.messages[0].content[0].text"),
])
def test_a_mistyped_field_is_reported_at_its_line_and_the_request_is_still_stored(tmp_path, body, param):
    path = tmp_path / "in.jsonl"
    path.write_bytes(line_bytes(line(chat_body(), "ok")) + b"\n" + line_bytes(line(body)) + b"\n")
    report = validate_to_parquet(path, tmp_path / "requests.parquet")
    assert report.valid and report.errors == []
    assert [(e.code, e.line, e.param) for e in report.rejected] == [("invalid_request", 2, param)]
    write_shards(tmp_path / "requests.parquet", tmp_path / "shards", shard_size=1)
    stored = dict(cid_body for shard in (tmp_path / "shards").iterdir() for cid_body in read_shard(shard))
    assert stored["a"] == body  # it runs into its own 400 line (tests/pipeline/test_request_isolation.py)


@pytest.mark.parametrize("body", [chat_body(extra=nested(300)), chat_body(temperature="hot", extra=nested(300)),
                                  chat_body(chat_template_kwargs=nested(200))])
def test_a_body_too_deep_to_store_is_a_400_line_at_its_line_and_is_stored_cut(tmp_path, body):
    path = tmp_path / "in.jsonl"
    path.write_bytes(line_bytes(line(chat_body(), "ok")) + b"\n" + line_bytes(line(body)) + b"\n")
    report = validate_to_parquet(path, tmp_path / "requests.parquet")
    assert report.valid and report.errors == []
    assert [(e.code, e.line) for e in report.rejected] == [("invalid_request", 2)]
    assert f"deeper than {MAX_DEPTH} levels" in report.rejected[0].message
    write_shards(tmp_path / "requests.parquet", tmp_path / "shards", shard_size=1)
    stored = dict(cid_body for shard in (tmp_path / "shards").iterdir() for cid_body in read_shard(shard))
    # Cut to MAX_DEPTH + 1 levels: still too deep, so the engine's check gives the same 400 line.
    with pytest.raises(RequestError, match=f"deeper than {MAX_DEPTH} levels"):
        check(c.CHAT, stored["a"])
