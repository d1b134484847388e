"""Issue #13, defect 1 on the real engine: mistyped requests and requests the engine refuses end as their own
400 lines, the rest of the batch completes, every custom_id once."""

from __future__ import annotations

import pytest

from tests.helpers import chat_request, run_on_real_engine

pytestmark = pytest.mark.engine


def rows_with_bad_requests() -> tuple[list[dict], dict[str, str], dict[str, str]]:
    """The batch, the mistyped requests (custom_id -> param) and the ones only the engine refuses."""
    good = [chat_request(f"good-{i}", f"Name a color, number {i}.", max_tokens=8, temperature=0) for i in range(3)]
    mistyped = {
        "hot": ({"temperature": "hot"}, "temperature"),
        "stop-5": ({"stop": 5}, "stop"),
        "top-p-list": ({"top_p": [1]}, "top_p"),
        "penalty-a": ({"presence_penalty": "a"}, "presence_penalty"),
        "kwargs-xy": ({"chat_template_kwargs": "xy"}, "chat_template_kwargs"),
        "negative-temperature": ({"temperature": -1}, "temperature"),
        # Refused by the field matrix: never sent, never silently dropped.
        "stream": ({"stream": True}, "stream"),
        "misspelt": ({"temprature": 0}, "temprature"),
        "functions": ({"functions": [{"name": "f"}]}, "functions"),
    }
    rows = good + [chat_request(cid, "Hello", **fields) for cid, (fields, _) in mistyped.items()]
    text_5 = chat_request("text-5", "Hello")
    text_5["body"]["messages"][0]["content"] = [{"type": "text", "text": 5}]
    rows.append(text_5)
    image = chat_request("image", "Hello")  # the embedded chat model takes no images (its registry entry)
    image["body"]["messages"][0]["content"] = [{"type": "text", "text": "What is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    rows.append(image)
    params = {cid: param for cid, (_, param) in mistyped.items()} | {"text-5": "messages[0].content[0].text",
                                                                     "image": "messages[0].content[1]"}
    # Valid in OpenAI's schema; vLLM refuses them.
    rows.append(chat_request("top-p-0", "Hello", top_p=0))
    rows.append(chat_request("too-long", "word " * 2500, max_tokens=16))
    refused = {"top-p-0": "invalid_request", "too-long": "context_length_exceeded"}
    return rows, params, refused


def check(summary, out, err, rows, params, refused, *, engine_params: dict[str, str] | None = None) -> None:
    assert summary["status"] == "completed"
    assert sorted([*out, *err]) == sorted(r["custom_id"] for r in rows)  # every custom_id once
    assert not set(out) & set(err)
    assert set(out) == {"good-0", "good-1", "good-2"}
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] for line in out.values())
    assert set(err) == set(params) | set(refused)
    for cid, param in params.items():
        error = err[cid]["response"]["body"]["error"]
        assert err[cid]["response"]["status_code"] == 400 and error["code"] == "invalid_request", cid
        assert error["param"] == param, (cid, error)
    for cid, code in refused.items():
        response = err[cid]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["code"] == code, (cid, response)
    for cid, param in (engine_params or {}).items():
        assert err[cid]["response"]["body"]["error"]["param"] == param, cid
    assert summary["request_counts"] == {"total": len(rows), "completed": 3, "failed": len(rows) - 3}


def test_bad_requests_end_as_their_own_lines_on_the_offline_engine(tmp_path, data_dir, instance):
    rows, params, refused = rows_with_bad_requests()
    summary, out, err = run_on_real_engine(tmp_path, data_dir, instance, rows)
    check(summary, out, err, rows, params, refused, engine_params={"top-p-0": "top_p", "too-long": "input_tokens"})


def test_bad_requests_end_as_their_own_lines_on_the_server_engine(tmp_path, data_dir, instance, vllm_server):
    rows, params, refused = rows_with_bad_requests()
    summary, out, err = run_on_real_engine(tmp_path, data_dir, instance, rows, mode="server",
                                           server_urls=[vllm_server])
    check(summary, out, err, rows, params, refused, engine_params={"top-p-0": "top_p", "too-long": "input_tokens"})
