"""The offline engine submits a shard's prompts in token order, so requests sharing a prefix are neighbours in
vLLM's first-come queue, and answers each request with its own output, in the shard's order."""

from __future__ import annotations

from types import SimpleNamespace

from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.engine.offline import OfflineEngine, _Prepared

CHAT = "/v1/chat/completions"


class RecordingLLM:
    """Stands in for vllm.LLM.generate: records the prompts' order and echoes each prompt's last token."""

    def __init__(self):
        self.submitted = []

    def generate(self, prompts, params, use_tqdm=False):
        self.submitted.append([p["prompt_token_ids"] for p in prompts])
        return [SimpleNamespace(num_cached_tokens=0, outputs=[SimpleNamespace(
            text=str(p["prompt_token_ids"][-1]), finish_reason="stop", token_ids=[1], stop_reason=None)])
            for p in prompts]


def engine_with(llm) -> OfflineEngine:
    engine = OfflineEngine(ModelSpec(name="m", source="/w"), "/w")
    engine._llm = llm
    return engine


def test_prompts_sharing_a_prefix_are_submitted_together_and_answered_in_shard_order():
    doc_a, doc_b = [5, 5, 5, 5], [3, 3, 3, 3]
    params = SimpleNamespace(temperature=0, top_p=1, max_tokens=4)
    prompts = {"a1": doc_a + [11], "b1": doc_b + [21], "a2": doc_a + [12], "b2": doc_b + [22], "a3": doc_a + [13]}
    items = [_Prepared(cid, [p], params, prompt_tokens=len(p)) for cid, p in prompts.items()]
    llm = RecordingLLM()
    lines = engine_with(llm)._execute(CHAT, items)

    submitted = llm.submitted[0]
    assert submitted == sorted(prompts.values())  # doc_b's questions, then doc_a's: each document's together
    assert [line["custom_id"] for line in lines] == list(prompts)  # the shard's order, each with its own answer
    for line in lines:
        answer = line["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == str(prompts[line["custom_id"]][-1])


def test_the_server_engine_sends_each_server_a_contiguous_run_in_prefix_order():
    from batch_dagster.engine.server import _sending_plan

    doc = {d: d + " word" * 300 for d in "abc"}
    requests = [(f"{d}{q}", {"model": "m", "messages": [{"role": "user", "content": doc[d] + f" question {q}?"}]})
                for q in range(4) for d in "abc"]  # shuffled: a0 b0 c0 a1 ...
    plan = _sending_plan(CHAT, requests, 2)
    assert sorted(row for row, _ in plan) == list(range(12))
    by_server = {k: [requests[row][0][0] for row, s in plan if s == k] for k in (0, 1)}
    assert len(by_server[0]) == len(by_server[1]) == 6
    for docs in by_server.values():  # each document's questions together, on as few servers as the split allows
        assert docs == sorted(docs, key=docs.index)
    assert sum(len(set(docs)) for docs in by_server.values()) <= 4
    assert [s for _, s in plan][:4] == [0, 1, 0, 1]  # interleaved: both servers busy from the start
