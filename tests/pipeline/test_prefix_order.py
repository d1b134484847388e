"""A shard's requests run in prefix order, the longest work first (batchfile/shard.py's running_order, which the
inference step applies), so requests sharing a prefix are neighbours in vLLM's first-come queue; both engines send
them in that order and answer each request with its own line, in that order."""

from __future__ import annotations

import asyncio

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.shard import running_order
from batch_dagster.engine.base import dispatch, sending_plan

CHAT = "/v1/chat/completions"


def chat(cid: str, text: str) -> tuple[str, dict]:
    return cid, {"model": "m", "messages": [{"role": "user", "content": text}]}


def test_prompts_sharing_a_prefix_are_sent_together_and_answered_in_shard_order():
    doc_a, doc_b = "a" * 1200, "b" * 1200  # longer than a prefix path's chunk
    requests = [chat("a1", doc_a + " one?"), chat("b1", doc_b + " one?"), chat("a2", doc_a + " two, longer?"),
                chat("b2", doc_b + " two, longer?"), chat("a3", doc_a + " three, the longest?")]
    sent: list[str] = []

    async def send(custom_id, body, lane):
        sent.append(custom_id)
        await asyncio.sleep(0)  # answered in another order than sent
        return c.success_line(custom_id, {"echo": body["messages"][0]["content"][-8:]})

    requests = [requests[i] for i in running_order(CHAT, requests)]
    lines = asyncio.run(dispatch(CHAT, requests, send))
    assert [s[0] for s in sent] in (list("aaabb"), list("bbaaa"))  # each document's questions together
    assert sent.index("a3") < sent.index("a2") < sent.index("a1")  # then the longest first
    assert [line["custom_id"] for line in lines] == [cid for cid, _ in requests]  # the shard's order
    for (_, body), line in zip(requests, lines, strict=True):
        assert line["response"]["body"]["echo"] == body["messages"][0]["content"][-8:]


def test_each_server_takes_a_contiguous_run_in_prefix_order():
    doc = {d: d + " word" * 300 for d in "abc"}
    requests = [(f"{d}{q}", {"model": "m", "messages": [{"role": "user", "content": doc[d] + f" question {q}?"}]})
                for q in range(4) for d in "abc"]  # shuffled: a0 b0 c0 a1 ...
    requests = [requests[i] for i in running_order(CHAT, requests)]
    plan = sending_plan(CHAT, requests, 2)
    assert sorted(row for row, _ in plan) == list(range(12))
    by_server = {k: [requests[row][0][0] for row, s in plan if s == k] for k in (0, 1)}
    assert len(by_server[0]) == len(by_server[1]) == 6
    for docs in by_server.values():  # each document's questions together, on as few servers as the split allows
        assert docs == sorted(docs, key=docs.index)
    assert sum(len(set(docs)) for docs in by_server.values()) <= 4
    assert [s for _, s in plan][:4] == [0, 1, 0, 1]  # interleaved: both servers busy from the start


def test_a_body_the_checks_refuse_is_its_400_line_and_never_sent():
    sent = []

    async def send(custom_id, body, lane):
        sent.append(custom_id)
        return c.success_line(custom_id, {})

    requests = [chat("good", "hi"), ("bad", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "temperature": "hot"})]
    seen = []
    lines = asyncio.run(dispatch(CHAT, requests, send, on_progress=seen.append))
    assert sent == ["good"] and sum(seen) == 2
    bad = lines[1]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"


def test_the_servers_runs_hold_about_the_same_work_not_the_same_count():
    """The longest first, a cut by count would give one server every long request: cut by work, it takes fewer."""
    requests = [("long", {"model": "m", "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 900}),
                *[(f"short{i}", {"model": "m", "messages": [{"role": "user", "content": f"short {i}"}],
                                 "max_tokens": 100}) for i in range(9)]]
    plan = sending_plan(CHAT, requests, 2)
    by_server = {k: [requests[row][0] for row, s in plan if s == k] for k in (0, 1)}
    assert by_server == {0: ["long"], 1: [f"short{i}" for i in range(9)]}
    assert [s for _, s in sending_plan(CHAT, requests[:1], 2)] == [0]  # a lone request: one server, the other idle
    assert sending_plan(CHAT, [], 2) == []
