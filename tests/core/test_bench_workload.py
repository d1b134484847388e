"""The benchmark's workload: fixed for a given size and model, shaped like the issue's (the harness runs in
tests/system/test_bench.py)."""

from __future__ import annotations

from bench.workload import MAX_PROMPT_TOKENS, requests, write_workload


def test_workload_is_fixed_and_shaped_like_the_issue(tmp_path):
    a = write_workload(tmp_path / "a.jsonl", 400, "m").read_bytes()
    assert a == write_workload(tmp_path / "b.jsonl", 400, "m").read_bytes()
    rows = list(requests(400, "m"))
    systems = [r["body"]["messages"][0]["content"] for r in rows if r["body"]["messages"][0]["role"] == "system"]
    assert 0.4 < len(systems) / len(rows) < 0.6 and len(set(systems)) == 3
    assert {r["body"]["temperature"] for r in rows} == {0}
    assert all(16 <= r["body"]["max_tokens"] <= 128 for r in rows)
    words = sorted(len(r["body"]["messages"][-1]["content"].split()) for r in rows)
    assert words[0] <= 10 and words[-1] > MAX_PROMPT_TOKENS / 4  # a few words up to a long tail
