"""Engine logic that needs no running model: failure isolation, the flags both engines run with, answers as lines."""

from __future__ import annotations

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.engine import lines as ln
from batch_dagster.engine.base import EngineCrash
from batch_dagster.engine.flags import engine_flags, parsed_args
from batch_dagster.engine.server import server_command
from tests.helpers import InProcessStub

CHAT = "/v1/chat/completions"


def ok(cid: str) -> dict:
    return c.success_line(cid, {"choices": []})


def oom(cid: str) -> dict:
    return ln.answer_line(cid, 500, {"error": {"message": "CPU out of memory: tried to allocate 8 GiB"}})


def requests(*ids):
    return [(i, {"model": "m", "messages": [{"role": "user", "content": i}]}) for i in ids]


def test_requests_out_of_memory_together_run_again_in_halves_until_the_culprit_is_alone():
    # Run beside others, "poison" and its neighbours run out of memory; alone, only "poison" does.
    def answer(cid, ids):
        return oom(cid) if "poison" in ids and (cid == "poison" or len(ids) > 2) else ok(cid)

    engine = InProcessStub(lambda cid, body, ids: answer(cid, ids))
    seen = []
    lines = engine.run(CHAT, requests("a", "b", "poison", "c", "d"), seen.append)
    by_id = {line["custom_id"]: line["response"] for line in lines}
    assert [line["custom_id"] for line in lines] == ["a", "b", "poison", "c", "d"]
    assert all(by_id[i]["status_code"] == 200 for i in "abcd")
    assert by_id["poison"]["status_code"] == 500 and by_id["poison"]["body"]["error"]["code"] == "out_of_memory"
    assert engine.calls[0] == ["a", "b", "poison", "c", "d"] and ["poison"] in engine.calls
    assert sum(seen) == 5  # each request counted once, when its line is final


def test_when_every_request_fails_the_engine_is_at_fault():
    engine = InProcessStub(lambda cid, body, ids: ln.answer_line(cid, 500, {"error": {"message": "broken engine"}}))
    with pytest.raises(EngineCrash, match="broken engine"):
        engine.run(CHAT, requests("a", "b"))
    assert len(engine.run(CHAT, requests("alone"))) == 1  # one request failing alone is its own error line


def test_answers_become_contract_lines():
    line = ln.answer_line("x", 400, {"error": {"message": "This model's maximum context length is 2048 tokens.",
                                              "type": "BadRequestError", "param": "messages", "code": 400}})
    err = line["response"]["body"]["error"]
    assert line["response"]["status_code"] == 400 and err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    assert ln.answer_line("x", 503, {"message": "overloaded"})["response"]["body"]["error"]["code"] == "engine_error"
    schema = ln.answer_line("x", 422, {"detail": [{"loc": ["body", "temperature"], "msg": "not a number"}]})
    assert schema["response"]["status_code"] == 400 and schema["response"]["body"]["error"]["code"] == "invalid_request"
    assert ln.answer_line("x", 400, {"error": {"message": "bad", "param": ["x"]}})["response"]["body"]["error"][
        "param"] is None
    success = ln.answer_line("x", 200, {"id": "chatcmpl-1"})
    assert success["custom_id"] == "x" and success["response"]["body"] == {"id": "chatcmpl-1"} and c.is_success(success)


def test_thinking_switch_goes_to_the_chat_template():
    body = {"messages": [], "enable_thinking": False, "chat_template_kwargs": {"x": 1}}
    sent = ln.vllm_body(CHAT, body)
    assert "enable_thinking" not in sent and sent["chat_template_kwargs"] == {"x": 1, "enable_thinking": False}
    assert ln.vllm_body(CHAT, {"messages": []}) == {"messages": []}


def test_both_engines_run_the_same_flags_parsed_by_vllms_own_server_parser():
    spec = ModelSpec(name="m", source="/w", dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False,
                     kv_cache_memory_bytes=0, tool_call_parser="hermes", reasoning_parser="qwen3",
                     engine_args={"enforce_eager": True})
    cmd = server_command(spec, "/w", "127.0.0.1", 9)
    assert cmd[-len(engine_flags(spec, "/w")):] == engine_flags(spec, "/w")
    assert cmd[cmd.index("--served-model-name") + 1] == "m" and cmd[cmd.index("--model") + 1] == "/w"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert "--kv-cache-memory-bytes" not in cmd  # 0 means unset
    args = parsed_args(spec, "/w")  # what the in-process engine runs
    assert (args.model, args.served_model_name, args.max_model_len, args.dtype) == ("/w", ["m"], 1024, "bfloat16")
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("hermes", True)
    # Forced tool calls' arguments follow the tool's parameters whether or not a tool says `strict: true`.
    assert args.tool_strict_level == "parameter"
    assert args.reasoning_parser == "qwen3"
    assert args.enable_prompt_tokens_details and args.enforce_eager and not args.enable_prefix_caching
    assert args.enable_scale_out  # the /render routes validation counts with
    bare = parsed_args(ModelSpec(name="e", source="/e", task="embed"), "/e")
    assert bare.runner == "pooling" and bare.tool_call_parser is None and not bare.enable_auto_tool_choice
    vision = parsed_args(ModelSpec(name="v", source="/v", images_per_request=2), "/v")
    assert vision.limit_mm_per_prompt == {"image": 2}
