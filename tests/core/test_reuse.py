"""The answer store: found by a content hash of the scope, the model's identity and the request, deterministic
requests only, reused as if answered now, bounded in bytes with the oldest answers out first."""

from __future__ import annotations

import time

from batch_dagster.batchfile import contract as c
from batch_dagster.features import reuse
from batch_dagster.features.reuse import AnswerStore, answer_key, keep, look_up, model_identity, renewed
from batch_dagster.storage import LocalStorage

RECORD = {"model": "m", "revision": "sha256:abc", "dtype": "bfloat16", "engine_mode": "offline",
          "engine_settings": {"max_num_seqs": 8, "engine_args": {"quantization": "fp8", "enforce_eager": True}}}
IDENTITY = model_identity(RECORD)
SCOPE = "owner:a"


def body(text: str, **params) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0, **params}


def answer(text: str) -> dict:
    return {"object": "chat.completion", "choices": [{"message": {"content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def test_the_key_covers_the_model_its_weights_the_numerics_and_the_request_only():
    assert IDENTITY == {"model": "m", "revision": "sha256:abc", "dtype": "bfloat16", "quantization": "fp8"}
    key = answer_key(SCOPE, IDENTITY, c.CHAT, body("hi"))
    # How fast it runs (engine mode, cache sizes) is not in it; the key order of the body is not either.
    assert key == answer_key(SCOPE, model_identity({**RECORD, "engine_mode": "server", "engine_settings": {
        "max_num_seqs": 64, "engine_args": {"quantization": "fp8"}}}), c.CHAT, dict(reversed(body("hi").items())))
    for other in ({**IDENTITY, "revision": "sha256:new"}, {**IDENTITY, "dtype": "float32"}):
        assert answer_key(SCOPE, other, c.CHAT, body("hi")) != key
    assert answer_key(SCOPE, IDENTITY, c.CHAT, body("hi", max_tokens=5)) != key


def test_each_scope_keeps_its_own_answers(tmp_path):
    """An owner's answers are found in its own scope only: another owner asking the same request of the same model
    finds nothing, computes it, and keeps its own."""
    store = AnswerStore(LocalStorage(tmp_path))
    assert answer_key("owner:a", IDENTITY, c.CHAT, body("hi")) != answer_key("owner:b", IDENTITY, c.CHAT, body("hi"))
    requests = [("q", body("the same question"))]
    keep(store, mine := look_up(store, "owner:a", IDENTITY, c.CHAT, requests), [c.success_line("q", answer("mine"))])
    assert mine.to_run == requests
    theirs = look_up(store, "owner:b", IDENTITY, c.CHAT, requests)
    assert theirs.lines == [] and theirs.to_run == requests
    again = look_up(store, "owner:a", IDENTITY, c.CHAT, requests)
    assert [line["custom_id"] for line in again.lines] == ["q"] and again.to_run == []


def test_a_reused_answer_is_renewed_as_if_answered_now():
    """Nothing of the first call stays in a reused body: its ids (the answer's, its tool calls', a response's items')
    are new, its creation time is now, its call's metrics are gone; the answer itself and the engine's fingerprint
    stay."""
    old = int(time.time()) - 3600
    chat = {"id": "chatcmpl-0123abcd", "object": "chat.completion", "created": old, "system_fingerprint": "vllm-x",
            "metrics": {"time_to_first_token_ms": 12.0},
            "choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "chatcmpl-tool-9f9f", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
    fresh = renewed(chat)
    assert fresh["id"].startswith("chatcmpl-") and fresh["id"] != chat["id"]
    assert fresh["created"] >= old + 3600 and "metrics" not in fresh and fresh["system_fingerprint"] == "vllm-x"
    call = fresh["choices"][0]["message"]["tool_calls"][0]
    assert call["id"].startswith("chatcmpl-tool-") and call["id"] != "chatcmpl-tool-9f9f"
    assert call["function"] == chat["choices"][0]["message"]["tool_calls"][0]["function"]
    assert chat["id"] == "chatcmpl-0123abcd"  # the kept answer itself is left as it was
    response = {"id": "resp_1", "object": "response", "created_at": old, "output": [
        {"id": "rs_1", "type": "reasoning"}, {"id": "fc_1", "type": "function_call", "call_id": "call_1"},
        {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": "hi"}]}]}
    fresh = renewed(response)
    assert fresh["created_at"] > old and fresh["id"].startswith("resp_") and fresh["id"] != "resp_1"
    assert [item["id"][:3] for item in fresh["output"]] == ["rs_", "fc_", "msg"]
    assert not {item["id"] for item in fresh["output"]} & {"rs_1", "fc_1", "msg_1"}
    assert fresh["output"][1]["call_id"].startswith("call_") and fresh["output"][1]["call_id"] != "call_1"
    assert fresh["output"][2]["content"] == response["output"][2]["content"]
    assert renewed(response)["id"] != fresh["id"]  # each line its own


def test_only_deterministic_requests_have_a_key():
    assert answer_key(SCOPE, IDENTITY, c.CHAT, {**body("hi"), "temperature": 0.7}) is None
    assert answer_key(SCOPE, IDENTITY, c.CHAT, {**body("hi"), "temperature": 0.7, "seed": 1}) is not None
    assert answer_key(SCOPE, IDENTITY, c.EMBEDDINGS, {"model": "e", "input": "hi"}) is not None


def test_a_shard_takes_what_the_store_holds_and_keeps_what_it_ran(tmp_path):
    store = AnswerStore(LocalStorage(tmp_path))
    requests = [("a", body("one")), ("b", body("two")), ("c", {**body("three"), "temperature": 1})]
    first = look_up(store, SCOPE, IDENTITY, c.CHAT, requests)
    assert first.lines == [] and first.to_run == requests and set(first.keys) == {"a", "b"}
    ran = [c.success_line("a", answer("1")), c.request_error_line("b", "x", "failed"), c.success_line("c", answer("3"))]
    assert keep(store, first, ran) == 1  # an error and a non-deterministic answer are not kept
    second = look_up(store, SCOPE, IDENTITY, c.CHAT, requests)
    assert [line["custom_id"] for line in second.lines] == ["a"] and [r[0] for r in second.to_run] == ["b", "c"]
    assert second.lines[0][c.REUSED] is True and second.lines[0]["response"]["body"]["choices"] == answer("1")["choices"]
    assert c.is_success(second.lines[0]) and not c.is_billed(second.lines[0])


def test_a_request_asked_twice_in_a_shard_runs_once_and_both_lines_say_the_same(tmp_path):
    store = AnswerStore(LocalStorage(tmp_path))
    sampled = {**body("two"), "temperature": 1}
    requests = [("a", body("one")), ("a2", body("one")), ("b", body("bad")), ("b2", body("bad")), ("a3", body("one")),
                ("c", sampled), ("c2", sampled)]
    shard = look_up(store, SCOPE, IDENTITY, c.CHAT, requests)
    # One of each deterministic request runs; a sampled one runs every time it is asked.
    assert [cid for cid, _ in shard.to_run] == ["a", "b", "c", "c2"]
    assert shard.twins == {"a2": "a", "b2": "b", "a3": "a"} and set(shard.keys) == {"a", "b"}
    ran = [c.success_line("a", answer("1")), c.request_error_line("b", "x", "too long", param="messages"),
           c.success_line("c", answer("3")), c.success_line("c2", answer("4"))]
    twins = {line["custom_id"]: line for line in shard.twin_lines(ran)}
    assert set(twins) == {"a2", "b2", "a3"}
    for cid in ("a2", "a3"):  # the answer, marked reused: billed at zero
        assert twins[cid]["response"]["body"]["choices"] == answer("1")["choices"] and twins[cid][c.REUSED] is True
        assert not c.is_billed(twins[cid])
    assert twins["b2"]["response"]["body"] == ran[1]["response"]["body"]  # the same error, param and all
    assert twins["b2"][c.REUSED] is True and not c.is_success(twins["b2"])
    ids = [line["id"] for line in [*ran, *twins.values()]]
    assert len(set(ids)) == len(ids)  # each line its own id
    assert keep(store, shard, ran) == 1 and store.get([shard.keys["a"]]) == {shard.keys["a"]: answer("1")}


def test_the_store_is_bounded_in_bytes_and_the_oldest_answers_go_first(tmp_path):
    storage = LocalStorage(tmp_path)
    size = len(b'{"object":"chat.completion"}') + 0
    store = AnswerStore(storage, max_bytes=3 * 200)
    keys = []
    for i in range(5):
        key = f"{i:02d}" + "0" * 62
        store.put({key: {"object": "chat.completion", "pad": "x" * (200 - size - 10)}})
        keys.append(key)
        time.sleep(0.002)
    assert store.size() <= 600
    kept = store.get(keys)
    assert set(kept) == set(keys[-3:]) or set(kept) == set(keys[-2:])  # the newest survive, the oldest are gone
    assert keys[0] not in kept and keys[-1] in kept
    assert len(store.ledgers()) == len(kept)


def test_an_answer_larger_than_the_store_is_never_kept(tmp_path):
    store = AnswerStore(LocalStorage(tmp_path), max_bytes=50)
    store.put({"k" * 64: {"pad": "x" * 100}})
    assert store.get(["k" * 64]) == {} and store.ledgers() == []


def test_a_ledger_name_carries_its_order_and_bytes():
    ledger = reuse.Ledger.parse("answers/ledger/1700000000000000000-1234-abcdef.json")
    assert ledger is not None and (ledger.written_ns, ledger.bytes) == (1_700_000_000_000_000_000, 1234)
    assert reuse.Ledger.parse("answers/ledger/junk.json") is None
