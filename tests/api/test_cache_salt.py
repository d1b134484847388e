"""Every request reaches the engine with its owner's cache_salt (vLLM's prefix cache is partitioned by it): the same
for one key's requests, another for another key's, a hash no client can choose; a request's own cache_salt partitions
only within its key's part. (tests/system/test_cache_salt.py shows the cached tokens on the real engine.)"""

from __future__ import annotations

import hashlib
import json
import re

from batch_dagster.batchfile import contract as c
from tests.helpers import CHAT_MODEL, KEY_A, KEY_B, InProcessStub, chat_request, fake_body, fake_vllm, upload, wait_for


class SaltsEngine(InProcessStub):
    """The in-process engine (its dispatch and checks as they are) with the app answering every request, keeping the
    cache_salt of each request sent, by custom_id."""

    def __init__(self):
        super().__init__(self.keep)
        self.salts: dict[str, str | None] = {}

    def keep(self, custom_id, body, ids):
        self.salts[custom_id] = body.get("cache_salt")
        return c.success_line(custom_id, fake_body(c.CHAT, CHAT_MODEL, "ok", 1, 1))


def salted_service(start_service, tmp_path, **settings):
    engine = SaltsEngine()
    return start_service(vllm=fake_vllm(f"salts-{tmp_path.name}", engine), **settings), engine


def run(client, tmp_path, rows, name: str):
    file_id = upload(client, tmp_path / f"{name}.jsonl", rows)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for(client, batch.id, "completed")
    lines = [json.loads(x) for fid in (batch.output_file_id, batch.error_file_id) if fid
             for x in client.files.content(fid).text.splitlines()]
    return {line["custom_id"]: line for line in lines}


def test_each_keys_requests_reach_the_engine_with_its_own_salt(start_service, tmp_path):
    service, engine = salted_service(start_service, tmp_path)
    a, b = service.client(KEY_A), service.client(KEY_B)
    run(a, tmp_path, [chat_request("a1", "the same long prompt"), chat_request("a2", "another prompt")], "a")
    run(b, tmp_path, [chat_request("b1", "the same long prompt"),
                      chat_request("b-own", "the same long prompt", cache_salt="user-42")], "b")
    lines = run(a, tmp_path, [chat_request("a-own", "the same long prompt", cache_salt="user-42"),
                              chat_request("a-bad", "the same long prompt", cache_salt="a/b")], "a-own")
    salts = engine.salts
    assert all(re.fullmatch(r"[0-9a-f]{64}", salts[cid]) for cid in ("a1", "a2", "b1", "b-own", "a-own"))
    assert salts["a1"] == salts["a2"] != salts["b1"]  # one salt per key
    owner = hashlib.sha256(KEY_A.encode()).hexdigest()
    assert owner not in salts.values()  # a keyed hash of the owner, not the owner
    # A request's own salt: a part of its key's, never another key's (the same value under two keys differs).
    assert salts["a-own"] not in (salts["a1"], salts["b-own"]) and salts["b-own"] != salts["b1"]
    # One vLLM would refuse ('/') is the request's own 400 line, never sent.
    assert "a-bad" not in salts
    error = lines["a-bad"]["response"]["body"]["error"]
    assert lines["a-bad"]["response"]["status_code"] == 400 and error["param"] == "cache_salt"


def test_keys_the_operator_shares_meet_the_same_prefixes(start_service, tmp_path):
    service, engine = salted_service(start_service, tmp_path, api_keys=(f"alice:{KEY_A}", f"bob:{KEY_B}", "carol:sk-test-c"),
                            shared_owners=("alice", "bob"))
    for name, key in (("alice", KEY_A), ("bob", KEY_B), ("carol", "sk-test-c")):
        run(service.client(key), tmp_path, [chat_request(name, "the same long prompt")], name)
    assert engine.salts["alice"] == engine.salts["bob"] != engine.salts["carol"]
