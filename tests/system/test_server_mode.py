"""Server mode: the same batch through a real vLLM server gives the same lines as offline mode."""

from __future__ import annotations

import pytest

from tests.helpers import chat_request, run_on_real_engine

pytestmark = pytest.mark.engine


def comparable(line):
    """A line without the parts that are unique per call (ids, timestamps)."""
    response = line["response"]
    body = response["body"]
    if response["status_code"] != 200:
        return (response["status_code"], body["error"]["code"], body["error"]["param"])
    return (
        response["status_code"],
        body["object"],
        body["model"],
        [(c["message"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]],
        {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    )


def test_server_mode_writes_the_same_lines_as_offline(tmp_path, data_dir, instance, vllm_server):
    rows = [
        chat_request("capital", "What is the capital of France?", max_tokens=16, temperature=0),
        chat_request("sys", "Name three colors.", max_tokens=24, temperature=0),
        chat_request("stop", "Count from one to five, one number per line.", max_tokens=30, temperature=0, stop=["\n"]),
        chat_request("too-long", "word " * 2500, max_tokens=16),
        chat_request("bad-temperature", "Hello", temperature=-1),
    ]
    rows[1]["body"]["messages"].insert(0, {"role": "system", "content": "You answer in one short line."})
    offline_dir, server_dir = tmp_path / "offline", tmp_path / "server"
    offline_dir.mkdir(), server_dir.mkdir()
    s1, out1, err1 = run_on_real_engine(offline_dir, data_dir, instance, rows)
    s2, out2, err2 = run_on_real_engine(server_dir, data_dir, instance, rows, mode="server", server_urls=[vllm_server])

    assert s1["request_counts"] == s2["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert set(out1) == set(out2) and set(err1) == set(err2)
    for cid in out1:
        assert comparable(out1[cid]) == comparable(out2[cid]), cid
    for cid in err1:
        assert comparable(err1[cid])[:2] == comparable(err2[cid])[:2], cid
    assert s1["usage"] == s2["usage"]
