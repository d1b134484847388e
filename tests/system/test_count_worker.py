"""The count worker on vLLM's own renderer (engine/render.py), and a vLLM server's /render routes: a body is counted
as the engine bills it, a client's template never renders, a worker killed is replaced."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.engine import counting
from batch_dagster.engine.hardware import dtype_choice
from batch_dagster.engine.lines import vllm_body
from batch_dagster.engine.models import Models
from batch_dagster.engine.prepare import smollm2_path
from tests.helpers import CHAT_MODEL, MODEL_CACHE, real_vllm

TURNS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": [{"type": "text", "text": "x3?"}]}]
BODIES = [  # (endpoint, body): each counted as the engine bills it
    (c.CHAT, {"messages": TURNS}),
    (c.CHAT, {"messages": TURNS[:2], "chat_template_kwargs": {"add_generation_prompt": True}}),
    (c.CHAT, {"messages": TURNS[:3], "chat_template_kwargs": {"continue_final_message": True}}),
    (c.CHAT, {"messages": TURNS[:3], "continue_final_message": True, "add_generation_prompt": False}),
    (c.CHAT, {"messages": TURNS[:2], "enable_thinking": False}),
    (c.RESPONSES, {"input": "Name three colors.", "instructions": "Be brief."}),
    (c.COMPLETIONS, {"prompt": "Once upon a time"}),
]
# A client's own template: rendered, it would count 5,000 words after a loop of a billion turns.
OWN = {"messages": TURNS[:2], "chat_template_kwargs": {
    "chat_template": "{% for i in range(10**9) %}{% endfor %}{{ 'word ' * 5000 }}"}}


@pytest.fixture(scope="module")
def models():
    if not (smollm2_path(MODEL_CACHE, dtype_choice("auto").dtype) / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 model is not prepared in {MODEL_CACHE} (make setup)")
    yield real_vllm().models
    counting.close_workers()


def test_the_worker_counts_as_the_models_template_renders_and_never_runs_a_clients_own(models: Models):
    count, context_length = models.counter(CHAT_MODEL)
    assert context_length == models.spec(CHAT_MODEL).max_model_len
    tokenizer = models.tokenizer(CHAT_MODEL)

    def rendered(messages: list) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"])

    as_text = [*TURNS[:3], {"role": "user", "content": "x3?"}]
    assert count(c.CHAT, {"model": CHAT_MODEL, "messages": TURNS}) == [rendered(as_text)]
    brief = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    assert count(c.RESPONSES, {"model": CHAT_MODEL, "input": "Name three colors.", "instructions": "Be brief."}) == [
        rendered(brief)]
    assert count(c.COMPLETIONS, {"model": CHAT_MODEL, "prompt": ["Once upon a time", "In a land"]}) == [
        len(tokenizer.encode("Once upon a time")), len(tokenizer.encode("In a land"))]
    assert count(c.COMPLETIONS, {"model": CHAT_MODEL, "prompt": [1, 2, 3]}) == [3]
    # Before: add_generation_prompt in the kwargs raised in the count (refused, 0 tokens); vLLM merges it and runs.
    assert count(c.CHAT, {"model": CHAT_MODEL, "messages": TURNS[:2],
                          "chat_template_kwargs": {"add_generation_prompt": True}}) == [rendered(TURNS[:2])]
    # A body the engine refuses is refused, not counted: no role, a prompt past the context.
    assert count(c.CHAT, {"model": CHAT_MODEL, "messages": [{"content": "no role"}]}) is None
    assert count(c.CHAT, {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}) is None
    # A client's own template is refused by vLLM before it renders: no loop of a billion turns (that would outlast
    # the body's deadline: CountTimeout), no 5,000 words counted.
    assert count(c.CHAT, {"model": CHAT_MODEL, **OWN}) is None


def test_a_killed_worker_is_replaced_on_the_next_count(models: Models):
    count, _ = models.counter(CHAT_MODEL)
    body = {"model": CHAT_MODEL, "messages": TURNS}
    first = count(c.CHAT, body)
    worker = counting.shared_worker(models.models_file, models.model_cache_dir)
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # out of memory, or killed by hand
    time.sleep(0.5)
    assert count(c.CHAT, body) == first and worker.pid not in (None, pid)


@pytest.mark.engine
def test_a_servers_render_routes_count_what_it_bills(models: Models, vllm_server):
    """The count of a model with servers goes to their /render routes: the same as the worker's, and each is the
    prompt tokens the server then bills for the body."""
    by_servers = counting.ServerCount([vllm_server], CHAT_MODEL)
    assert by_servers.context_length() == models.spec(CHAT_MODEL).max_model_len
    worker, _ = models.counter(CHAT_MODEL)
    for endpoint, fields in BODIES:
        body = {"model": CHAT_MODEL, **fields}
        counted = by_servers.count(endpoint, body, 30)
        assert counted == worker(endpoint, body), (endpoint, fields)
        billed = httpx.post(vllm_server + endpoint, json=vllm_body(endpoint, {**body, "max_tokens": 1}),
                            timeout=120).json()["usage"]
        assert counted == [billed.get("prompt_tokens", billed.get("input_tokens"))], (endpoint, fields, billed)
    assert by_servers.count(c.CHAT, {"model": CHAT_MODEL, **OWN}, 30) is None
    assert httpx.post(vllm_server + c.CHAT, json={"model": CHAT_MODEL, **OWN}, timeout=30).status_code == 400
