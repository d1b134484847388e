"""The answer store is kept per owner: a key asking `reuse` finds only its own answers (unless the operator shares
them, BATCH_SHARED_OWNERS), so it never learns whether, or when, another key asked the same request; a reused answer
reads as if answered now (new ids, `created` now)."""

from __future__ import annotations

import json
import time
import uuid

from tests.helpers import KEY_A, KEY_B, FakeEngine, chat_request, upload, wait_for

DETERMINISTIC = [chat_request(f"q{i}", f"question number {i}", temperature=0, max_tokens=8) for i in range(3)]
AN_HOUR = 3600


class StampingEngine(FakeEngine):
    """The fake engine, each answer with an id of its own and a `created` an hour ago, as the call that made it."""

    def run(self, endpoint, requests, on_progress=None):
        lines = super().run(endpoint, requests, on_progress)
        for line in lines:
            body = line["response"]["body"]
            if line["response"]["status_code"] == 200:
                body["id"], body["created"] = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()) - AN_HOUR
                body["system_fingerprint"] = "vllm-0.32.0-abcdef12"
        return lines


def run(client, tmp_path, rows, name: str, **extra):
    file_id = upload(client, tmp_path / f"{name}.jsonl", rows)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body=extra)
    batch = wait_for(client, batch.id, "completed")
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    return batch, {line["custom_id"]: line for line in lines}


def test_a_key_learns_nothing_from_reuse_of_what_another_key_asked(start_service, tmp_path):
    service = start_service(engine=StampingEngine())
    a, b = service.client(KEY_A), service.client(KEY_B)
    first, _ = run(a, tmp_path, DETERMINISTIC, "a-first", reuse=True)
    ran = len(service.engine.calls)

    # B asks the very same deterministic requests: computed for B, billed to B, nothing says A asked them.
    batch, lines = run(b, tmp_path, DETERMINISTIC, "b", reuse=True)
    assert not any(line.get("reused") for line in lines.values())
    assert sorted(cid for call in service.engine.calls[ran:] for cid in call) == ["q0", "q1", "q2"]
    billed = sum(line["response"]["body"]["usage"]["total_tokens"] for line in lines.values())
    assert batch.usage.total_tokens == billed == first.usage.total_tokens > 0

    # A's own answers are still A's to reuse.
    _, again = run(a, tmp_path, DETERMINISTIC, "a-again", reuse=True)
    assert all(line.get("reused") for line in again.values())


def test_a_reused_answer_reads_as_if_answered_now(start_service, tmp_path):
    service = start_service(engine=StampingEngine())
    client = service.client(KEY_A)
    _, first = run(client, tmp_path, DETERMINISTIC, "first", reuse=True)
    asked = int(time.time())
    _, again = run(client, tmp_path, DETERMINISTIC, "again", reuse=True)
    for cid, line in again.items():
        body, before = line["response"]["body"], first[cid]["response"]["body"]
        assert line["reused"] is True and body["choices"] == before["choices"]
        assert body["id"] != before["id"] and body["id"].startswith("chatcmpl-")  # not the first call's id
        assert body["created"] >= asked > before["created"]  # not when it was first computed
        assert body["system_fingerprint"] == before["system_fingerprint"]  # the engine's, not the call's
    assert len({line["response"]["body"]["id"] for line in again.values()}) == len(again)


def test_the_operator_may_let_named_keys_share_their_answers(start_service, tmp_path):
    service = start_service(api_keys=(f"alice:{KEY_A}", f"bob:{KEY_B}", "carol:sk-test-c"),
                            shared_owners=("alice", "bob"))
    a, b, carol = service.client(KEY_A), service.client(KEY_B), service.client("sk-test-c")
    run(a, tmp_path, DETERMINISTIC, "alice", reuse=True)
    _, shared = run(b, tmp_path, DETERMINISTIC, "bob", reuse=True)
    assert all(line.get("reused") for line in shared.values())  # bob shares with alice
    _, own = run(carol, tmp_path, DETERMINISTIC, "carol", reuse=True)
    assert not any(line.get("reused") for line in own.values())  # carol shares with nobody
