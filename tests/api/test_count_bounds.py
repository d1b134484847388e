"""The count behind estimates and validation, bounded: a client's own template never renders, a body that renders too
long is stopped (its count worker killed and replaced) and named by its line, and the estimate lane holds a bounded
number of estimates across keys. Bodies are rendered by the word renderer of tests/word_render.py in a real count
worker process (engine/counting.py); tests/system/test_count_worker.py renders with vLLM's."""

from __future__ import annotations

import os
import threading
import time

import pytest

from batch_dagster.api import context
from batch_dagster.batchfile import contract as c
from batch_dagster.engine import counting, tokens
from batch_dagster.engine.models import Models
from tests.helpers import KEY_A, KEY_B, Flood, chat_request, upload, wait_for

CREATE = {"endpoint": c.CHAT, "completion_window": "24h"}


def estimate(service, file_id: str, key: str | None = None):
    with service.http(key or KEY_A) as http:
        return http.post("/v1/batches/estimate", json={"input_file_id": file_id, **CREATE}, timeout=60)


def worker_pid(service) -> int | None:
    """The pid of the API's count worker (the API runs in the test's process)."""
    return counting.shared_worker(str(service.config.models_file), str(service.config.model_cache_dir)).pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_clients_template_is_refused_at_its_line_and_never_counted(start_service, tmp_path):
    """Before: the count rendered the client's template (here 5,000 words, or a loop of minutes), and a line with
    add_generation_prompt in its kwargs raised in the count, so it counted 0 tokens while the engine ran it."""
    service = start_service(worker=False)
    client = service.client()
    template = "{% for i in range(10**9) %}{% endfor %}{{ 'word ' * 5000 }}"
    rows = [chat_request("a", "one two three"),
            chat_request("own", "four five six", chat_template_kwargs={"chat_template": template}),
            chat_request("gen", "seven eight", chat_template_kwargs={"add_generation_prompt": True})]
    file_id = upload(client, tmp_path / "in.jsonl", rows)
    answer = estimate(service, file_id).json()
    assert answer["valid"] and answer["refused_requests"] == 1
    assert answer["input_tokens"] == 3 + 2  # "own" is never counted; "gen" is, as the engine runs it

    # tests/system/test_estimate.py runs such lines on the engine: the same 400 line, the same billed tokens.


def test_an_estimate_stops_at_its_deadline_and_the_api_stays_responsive(start_service, tmp_path):
    """Before: the estimate lane had no deadline; a body whose template ran for minutes held its thread that long."""
    service = start_service(worker=False, estimate_timeout_s=2.0)
    assert estimate(service, upload(service.client(), tmp_path / "a.jsonl", [chat_request("a", "x")])).is_success
    before = worker_pid(service)
    hanging = upload(service.client(), tmp_path / "hang.jsonl",
                     [chat_request("a", "fine"), chat_request("b", "HANG forever"), chat_request("c", "fine")])
    answered: list = []
    thread = threading.Thread(target=lambda: answered.append(estimate(service, hanging)))
    thread.start()
    with service.http(KEY_B) as other:  # another key is served while the count hangs
        while thread.is_alive() and not answered:
            assert other.get("/v1/batches", timeout=10).status_code == 200
            time.sleep(0.2)
    thread.join(30)
    [answer] = answered
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == c.COUNT_TIMEOUT
    assert error["message"].startswith("Line 2: ") and "deadline of 2 s" in error["message"]
    assert before is not None and not alive(before) and worker_pid(service) is None  # its worker was killed
    assert estimate(service, upload(service.client(), tmp_path / "b.jsonl", [chat_request("b", "x")])).is_success
    assert worker_pid(service) not in (None, before)  # the next count started another
    assert estimate(service, hanging).json()["error"]["code"] == c.COUNT_TIMEOUT  # a stopped count is not kept


def test_validation_names_a_line_that_renders_past_its_bound(start_service, tmp_path, monkeypatch):
    """A body that renders longer than the engine's own bound fails the batch at its line: nothing runs."""
    monkeypatch.setattr(tokens, "LINE_TIMEOUT_S", 1.0)
    service = start_service()
    client = service.client()
    rows = [chat_request("a", "fine"), chat_request("b", "fine too"), chat_request("c", "HANG")]
    batch = client.batches.create(input_file_id=upload(client, tmp_path / "in.jsonl", rows), **CREATE)
    failed = wait_for(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and service.engine.calls == []
    [error] = failed.errors.data
    assert (error.code, error.line) == (c.COUNT_TIMEOUT, 3) and "did not render within 1 s" in error.message


def test_the_estimate_lane_holds_a_bounded_number_of_estimates_across_keys(start_service, tmp_path, monkeypatch):
    """Before: only each key's estimates were bounded; many keys' floods all waited, each holding its request."""
    monkeypatch.setattr(context, "ESTIMATES_QUEUED", 3)
    release, count = threading.Event(), Models.counter

    def held(self, model, **kwargs):
        release.wait(60)
        return count(self, model, **kwargs)

    monkeypatch.setattr(Models, "counter", held)
    service = start_service(worker=False)
    file_id = upload(service.client(), tmp_path / "in.jsonl", [chat_request("a", "one two")])
    body = {"input_file_id": file_id, **CREATE}
    flood = Flood(service, "/v1/batches/estimate", body, 5)
    flood.wait_answered(2)
    assert flood.statuses == [503, 503] and flood.held() == 3
    other = estimate(service, upload(service.client(KEY_B), tmp_path / "b.jsonl", [chat_request("b", "x")]), KEY_B)
    error = other.json()["error"]
    assert other.status_code == 503 and error["code"] == "estimates_busy" and "3 estimates" in error["message"]
    release.set()
    assert sorted(flood.join()) == [200, 200, 200, 503, 503]
    assert estimate(service, file_id, KEY_B).status_code == 404  # served again (another key's file: not found)


@pytest.fixture(autouse=True)
def no_worker_left():
    """Each test's count workers end with it (the next test starts its own)."""
    yield
    counting.close_workers()
