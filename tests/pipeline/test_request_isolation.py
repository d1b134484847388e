"""One bad request never fails a batch (issue #13, defect 1): the offline engine prepares every request
(chat template, SamplingParams) before the shard runs, so whatever it refuses for one body is that
request's 400 line; and random body mutations through batch_job never lose a custom_id."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.batchfile.validate import validate_stream
from batch_dagster.defs.runner import run_batch
from batch_dagster.engine import translate as t
from batch_dagster.engine.hardware import dtype_choice
from batch_dagster.engine.offline import OfflineEngine
from batch_dagster.engine.prepare import smollm2_path
from batch_dagster.engine.server import _error_line
from tests.helpers import CHAT_MODEL, MODEL_CACHE, chat_request, fake_vllm, make_defs, read_jsonl, write_jsonl


class TranslatingEngine(OfflineEngine):
    """The offline engine with only the model swapped out: the model's real tokenizer and chat template,
    vLLM's real SamplingParams, the same translation; `_execute` answers instead of generating."""

    def __init__(self, tokenizer, max_model_len: int = 2048):
        super().__init__(ModelSpec(name=CHAT_MODEL, source="/nowhere"), "/nowhere")
        self._llm, self._tokenizer, self.max_model_len = object(), tokenizer, max_model_len  # "started"
        self.calls: list[list[str]] = []

    def run(self, endpoint, requests, on_progress=None):  # the resource's engine interface
        return super().run(endpoint, requests, on_progress)

    def _execute(self, endpoint, items):
        self.calls.append([it.custom_id for it in items])
        lines = []
        for it in items:
            choices = [t.Choice("ok", "stop", 1) for _ in range(it.params.n)]
            lines.append(c.success_line(it.custom_id, t.chat_completion(CHAT_MODEL, choices, it.prompt_tokens)))
        return lines


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path(MODEL_CACHE, dtype_choice("auto").dtype))


def body(**fields) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}


# What validation reports as mistyped (stored all the same, it ends at the engine), and what passes
# validation but vLLM refuses.
REFUSED = {
    "hot": (body(temperature="hot"), "temperature"),
    "stop": (body(stop=5), "stop"),
    "top-p-list": (body(top_p=[1]), "top_p"),
    "penalty": (body(presence_penalty="a"), "presence_penalty"),
    "kwargs": (body(chat_template_kwargs="xy"), "chat_template_kwargs"),
    "text-5": ({**body(), "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
               "messages[0].content[0].text"),
    "top-p-0": (body(top_p=0), "top_p"),
    "min-tokens": (body(min_tokens=50), "min_tokens"),  # more than max_tokens
    "too-long": (body(max_tokens=4000), "messages"),
}


# Where the engine itself names the field, had validation's check let the mistyped ones through.
ENGINE_PARAMS = {"text-5": "messages"}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_the_engine_turns_each_refused_body_into_its_own_400_and_runs_the_rest_once(tokenizer, monkeypatch,
                                                                                    checked):
    if not checked:  # defence in depth: SamplingParams' TypeErrors and the chat template's errors
        monkeypatch.setattr(t, "check", lambda endpoint, body: None)
    engine = TranslatingEngine(tokenizer)
    requests = [("good-1", body()), *((cid, b) for cid, (b, _) in REFUSED.items()), ("good-2", body(n=2))]
    lines = {line["custom_id"]: line for line in engine.run(c.CHAT, requests)}

    assert sorted(lines) == sorted(cid for cid, _ in requests)
    assert engine.calls == [["good-1", "good-2"]]  # one engine call, with the good requests only
    assert lines["good-2"]["response"]["status_code"] == 200
    for cid, (_, param) in REFUSED.items():
        response = lines[cid]["response"]
        assert response["status_code"] == 400, cid
        assert response["body"]["error"]["code"] in ("invalid_request", "context_length_exceeded"), cid
        assert response["body"]["error"]["param"] == (param if checked else ENGINE_PARAMS.get(cid, param)), cid


def test_a_server_that_refuses_the_body_schema_gives_a_400_line():
    line = _error_line("x", 422, {"detail": [{"loc": ["body", "temperature"], "msg": "not a number"}]})
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["code"] == "invalid_request"
    assert _error_line("x", 400, {"error": {"message": "bad", "param": ["x"]}})["response"]["body"]["error"]["param"] is None


# Random per-request body mutations through batch_job.

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                              optional={"text": st.text(max_size=10), "image_url": st.just({"url": "http://x"})})
# Values at and past the edges of what the schema and vLLM take, most of them valid.
edges = {
    "temperature": st.sampled_from([0, 0.0, 1e-9, 2, 2.0001, -0.1, "hot"]),
    "top_p": st.sampled_from([0, 1e-9, 1, 1.5, [1]]),
    "max_tokens": st.sampled_from([1, 8, 2047, 4000, 2**63, 0, 1.0]),
    "n": st.integers(0, 4),
    "stop": st.sampled_from(["x", ["a", "b"], [], [""], 5, [5]]),
    "seed": st.sampled_from([-(2**63), 0, 2**63 - 1, 2**64]),
    "presence_penalty": st.sampled_from([-2, 2, 0.5, "a"]),
    "top_k": st.sampled_from([-1, 0, 1, 50, 1.5]),
    "min_p": st.sampled_from([0, 1, 0.5]),
    "repetition_penalty": st.sampled_from([0.01, 1, 2, 0]),
    "min_tokens": st.integers(0, 20),
    "ignore_eos": st.booleans(),
    "logprobs": st.booleans(),
    "logit_bias": st.sampled_from([{}, {"5": 1}, {"x": 200}]),
    "enable_thinking": st.booleans(),
    "chat_template_kwargs": st.sampled_from([{}, {"enable_thinking": False}, {"add_generation_prompt": "x"}, "xy"]),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
        optional={"content": st.none() | st.text(max_size=20) | st.lists(parts, max_size=2), "name": st.text(max_size=5)},
    ), min_size=1, max_size=3),
}
mutation = st.one_of(
    st.sampled_from(sorted(edges)).flatmap(lambda k: edges[k].map(lambda v: (k, v))),
    st.tuples(st.sampled_from(sorted(edges)), json_values),
)


def accepted(request: dict) -> bool:
    return validate_stream(io.BytesIO(json.dumps(request).encode())).valid


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutations=st.lists(st.lists(mutation, max_size=3), min_size=4, max_size=12))
def test_random_body_mutations_never_fail_a_batch_nor_lose_a_custom_id(tmp_path_factory, data_dir, instance,
                                                                      tokenizer, mutations):
    tmp = tmp_path_factory.mktemp("mutations")
    rows = []
    for i, changes in enumerate(mutations):
        row = chat_request(f"r{i}", f"question {i}", max_tokens=4)
        row["body"].update(dict(changes))
        # A line validation refuses would fail the file at its line (tests/core covers that): leave it out.
        rows.append(row if accepted(row) else chat_request(f"r{i}", "plain"))
    defs = make_defs(data_dir, fake_vllm("translating", TranslatingEngine(tokenizer)), shard_size=4)
    summary = run_batch(write_jsonl(tmp / "in.jsonl", rows), tmp / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()

    assert summary["status"] == "completed", summary
    out, err = read_jsonl(tmp / "out" / "output.jsonl"), read_jsonl(tmp / "out" / "errors.jsonl")
    assert sorted(l["custom_id"] for l in out + err) == sorted(r["custom_id"] for r in rows)
    assert all(l["response"]["status_code"] == 400 for l in err), err
    assert summary["request_counts"] == {"total": len(rows), "completed": len(out), "failed": len(err)}


def nested(levels: int) -> object:
    value: object = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize("endpoint", [c.CHAT, c.RESPONSES])
def test_a_body_nested_too_deep_is_its_own_400_line_and_the_batch_completes(tmp_path, data_dir, instance, tokenizer,
                                                                          endpoint):
    def request(cid: str, **extra) -> dict:
        payload = {"input": "hi"} if endpoint == c.RESPONSES else {"messages": [{"role": "user", "content": "hi"}]}
        return {"custom_id": cid, "method": "POST", "url": endpoint, "body": {"model": CHAT_MODEL, **payload, **extra}}

    rows = [request("good"), request("deep", metadata={"k": nested(300)}), request("deeper", extra=nested(600))]
    defs = make_defs(data_dir, fake_vllm(f"deep-{endpoint}", TranslatingEngine(tokenizer)), shard_size=4)
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()

    assert summary["status"] == "completed", summary
    err = {line["custom_id"]: line["response"] for line in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert sorted(err) == ["deep", "deeper"]
    for cid, param in (("deep", "metadata"), ("deeper", "extra")):
        assert err[cid]["status_code"] == 400
        error = err[cid]["body"]["error"]
        assert error["param"] == param and "nested deeper than 64 levels" in error["message"], error
    assert [l["custom_id"] for l in read_jsonl(tmp_path / "out" / "output.jsonl")] == ["good"]
