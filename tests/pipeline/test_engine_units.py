"""Engine logic that needs no running model: failure isolation, request translation, server errors."""

from __future__ import annotations

import pytest

from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.engine import translate as t
from batch_dagster.engine.base import EngineCrash
from batch_dagster.engine.offline import OfflineEngine, _Prepared
from batch_dagster.engine.server import _error_line, server_body, server_command


class StubbedEngine(OfflineEngine):
    """An offline engine whose engine call is scripted: `poison` ids make a whole call fail."""

    def __init__(self, failure):
        super().__init__(ModelSpec(name="m", source="/nowhere"), "/nowhere")
        self.failure = failure
        self.calls = []

    def _execute(self, endpoint, items):
        ids = [it.custom_id for it in items]
        self.calls.append(ids)
        if "poison" in ids:
            raise self.failure
        return [{"custom_id": i, "response": {"status_code": 200, "body": {}}, "error": None} for i in ids]


def items(*ids):
    return [_Prepared(i, [[1, 2, 3]]) for i in ids]


def test_out_of_memory_splits_the_shard_until_the_culprit_is_alone():
    engine = StubbedEngine(RuntimeError("CPU out of memory: tried to allocate 8 GiB"))
    lines = engine._run_isolating("/v1/chat/completions", items("a", "b", "poison", "c", "d"))
    by_id = {l["custom_id"]: l for l in lines}
    assert sorted(by_id) == ["a", "b", "c", "d", "poison"]
    assert all(by_id[i]["response"]["status_code"] == 200 for i in "abcd")
    err = by_id["poison"]["response"]
    assert err["status_code"] == 500 and err["body"]["error"]["code"] == "out_of_memory"
    assert engine.calls[0] == ["a", "b", "poison", "c", "d"] and ["poison"] in engine.calls


def test_a_request_the_engine_rejects_is_isolated_as_a_400():
    from vllm.exceptions import VLLMValidationError

    engine = StubbedEngine(VLLMValidationError("token id 99999 out of vocabulary", parameter="prompt"))
    lines = engine._run_isolating("/v1/completions", items("a", "poison"))
    bad = next(l for l in lines if l["custom_id"] == "poison")["response"]
    assert bad["status_code"] == 400
    assert bad["body"]["error"]["param"] == "prompt" and "vocabulary" in bad["body"]["error"]["message"]


def test_any_other_failure_is_an_engine_crash_for_the_whole_shard():
    engine = StubbedEngine(ConnectionError("engine core died"))
    with pytest.raises(EngineCrash, match="engine core died"):
        engine._run_isolating("/v1/chat/completions", items("a", "poison"))
    assert len(engine.calls) == 1  # no splitting: the shard is retried as a whole


def test_max_tokens_and_context_check():
    chat = {"messages": [], "max_tokens": 100}
    assert t.max_tokens_of("/v1/chat/completions", chat, 50, 2048) == 100
    assert t.max_tokens_of("/v1/chat/completions", {"messages": []}, 48, 2048) == 2000  # rest of the context
    assert t.max_tokens_of("/v1/completions", {"prompt": "x"}, 5, 2048) == 16
    assert t.max_tokens_of("/v1/chat/completions", {"max_completion_tokens": 7, "max_tokens": 99}, 5, 2048) == 7
    with pytest.raises(t.RequestError) as exc:
        t.max_tokens_of("/v1/chat/completions", chat, 1990, 2048)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    with pytest.raises(t.RequestError, match="positive integer"):
        t.max_tokens_of("/v1/chat/completions", {"max_tokens": 0}, 5, 2048)


def test_sampling_kwargs_take_openai_fields_and_defaults():
    kw = t.sampling_kwargs({"temperature": 0, "n": 2, "stop": ["."], "seed": 3, "logprobs": None, "foo": 1}, 32)
    assert kw == {"temperature": 0, "n": 2, "stop": ["."], "seed": 3, "max_tokens": 32}
    assert t.sampling_kwargs({}, 8)["temperature"] == 1.0


def test_thinking_switch_goes_to_the_chat_template():
    body = {"messages": [], "enable_thinking": False, "chat_template_kwargs": {"x": 1}}
    assert t.chat_template_kwargs(body) == {"x": 1, "enable_thinking": False}
    sent = server_body("/v1/chat/completions", body)
    assert "enable_thinking" not in sent and sent["chat_template_kwargs"] == {"x": 1, "enable_thinking": False}


def test_content_parts_become_text():
    msgs = t.chat_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}]})
    assert msgs[0]["content"] == "ab"
    with pytest.raises(t.RequestError):
        t.chat_messages({"messages": ["not a message"]})


def test_server_errors_map_to_contract_lines():
    line = _error_line("x", 400, {"error": {"message": "This model's maximum context length is 2048 tokens.",
                                            "type": "BadRequestError", "param": "messages", "code": 400}})
    err = line["response"]["body"]["error"]
    assert line["response"]["status_code"] == 400 and err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert _error_line("x", 503, {"message": "overloaded"})["response"]["body"]["error"]["code"] == "engine_error"


def test_server_command_carries_the_registry_settings():
    spec = ModelSpec(name="m", source="/w", dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False,
                     kv_cache_memory_bytes=0, engine_args={"enforce_eager": True})
    cmd = server_command(spec, "/w", "127.0.0.1", 9)
    assert cmd[cmd.index("--served-model-name") + 1] == "m" and cmd[cmd.index("--model") + 1] == "/w"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert "--kv-cache-memory-bytes" not in cmd  # 0 means unset


def test_when_every_request_fails_alone_the_engine_is_at_fault():
    class AlwaysRejects(StubbedEngine):
        def _execute(self, endpoint, items):
            raise ValueError("broken engine")

    engine = AlwaysRejects(None)
    engine._llm, engine._tokenizer, engine.max_model_len = object(), None, 64  # pretend it started
    with pytest.raises(EngineCrash, match="broken engine"):
        engine.run("/v1/completions", [("a", {"prompt": [1, 2]}), ("b", {"prompt": [3]})])


def test_progress_ticker_counts_finished_requests_and_passes_iterables_through():
    from batch_dagster.engine.base import ProgressTicker

    seen = []
    ticker = ProgressTicker(seen.append)
    assert ticker([1, 2, 3], desc="Adding requests") == [1, 2, 3]
    bar = ticker(total=3, desc="Processed prompts")
    bar.update(2)
    bar.update(1)
    assert seen == [2, 1] and bar.n == 3 and bar.format_dict["elapsed"] > 0
