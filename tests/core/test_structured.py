"""Structured outputs cut short by their token limit: which requests asked for one, which answers were cut, and the
count a batch keeps of them (request_counts.incomplete_structured)."""

from __future__ import annotations

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.results import commit_shard, committed_shards, progress_of
from batch_dagster.batchfile.structured import asks_structured, cut_short
from batch_dagster.storage import LocalStorage

SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
TOOL = {"type": "function", "function": {"name": "f"}}


def test_which_requests_ask_for_structured_output():
    assert asks_structured(c.CHAT, {"response_format": SCHEMA})
    assert asks_structured(c.CHAT, {"response_format": {"type": "json_object"}})
    assert not asks_structured(c.CHAT, {"response_format": {"type": "text"}})
    assert asks_structured(c.COMPLETIONS, {"structured_outputs": {"regex": "[0-9]+"}})
    assert asks_structured(c.CHAT, {"tools": [TOOL], "tool_choice": "required"})
    assert asks_structured(c.CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert not asks_structured(c.CHAT, {"tools": [TOOL], "tool_choice": "auto"})
    assert asks_structured(c.RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}})
    assert not asks_structured(c.RESPONSES, {"text": {"format": {"type": "text"}}})
    assert not asks_structured(c.CHAT, {"messages": []})


def chat_answer(*reasons: str) -> dict:
    return {"object": "chat.completion", "choices": [{"finish_reason": r} for r in reasons],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


def test_the_shard_counts_the_structured_answers_cut_short(tmp_path):
    assert cut_short(chat_answer("stop", "length")) and not cut_short(chat_answer("stop", "tool_calls"))
    assert cut_short({"object": "response", "status": "incomplete"})
    assert not cut_short({"object": "response", "status": "completed"})

    storage = LocalStorage(tmp_path)
    lines = [c.success_line("cut", chat_answer("length")), c.success_line("whole", chat_answer("stop")),
             c.success_line("free", chat_answer("length")),  # cut, but it asked for no structure
             c.request_error_line("bad", c.INVALID_REQUEST, "no")]
    summary = commit_shard(storage, "r", 0, lines, structured={"cut", "whole", "bad"})
    assert summary.request_counts == c.RequestCounts(total=4, completed=3, failed=1, incomplete_structured=1)
    assert committed_shards(storage, "r")[0].request_counts.incomplete_structured == 1
    counts = progress_of(committed_shards(storage, "r"), 4, 1).counts()
    assert counts.to_dict() == {"total": 4, "completed": 3, "failed": 1, "incomplete_structured": 1}
    assert "1 with structured output cut short" in counts.describe()
    assert c.RequestCounts(total=2, completed=2).to_dict() == {"total": 2, "completed": 2, "failed": 0}
