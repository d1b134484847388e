"""The estimate on the real engine: its prompt tokens are the ones the engine bills, exactly, and the real cost lies
in its range (POST /v1/batches/estimate through the openai SDK, then the same file run as a batch)."""

from __future__ import annotations

import json

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder
from tests.api.conftest import start_service  # noqa: F401 - the in-process API, here with the real engine
from tests.helpers import CHAT_MODEL, real_vllm, upload, wait_for

pytestmark = pytest.mark.engine


def chat(cid: str, messages: list[dict], **params) -> dict:
    body = {"model": CHAT_MODEL, "messages": messages, "temperature": 0, **params}
    return {"custom_id": cid, "method": "POST", "url": c.CHAT, "body": body}


def sys_(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# Several system prompts (and none: the template's own), multi-turn, content parts, max_tokens and
# max_completion_tokens, n > 1.
ROWS = [
    chat("plain", [user("What is the capital of France?")], max_tokens=12),
    chat("pirate", [sys_("You are a pirate. Answer in one line."), user("Where is the treasure?")], max_tokens=10),
    chat("turns", [sys_("You are a terse math tutor."), user("What is 2 + 2?"), assistant("4."),
                   user("And times 3?")], max_completion_tokens=8),
    chat("parts", [sys_("You are a pirate. Answer in one line."),
                   {"role": "user", "content": [{"type": "text", "text": "Name a ship. "},
                                                {"type": "text", "text": "Only its name."}]}], max_tokens=6),
    chat("two", [sys_("Reply with one French word."), user("Hello"), assistant("Bonjour"), user("Thanks")],
         max_tokens=5, n=2, temperature=0.8, seed=1),
    chat("greedy-two", [user("Say yes.")], max_tokens=3, n=2),  # the engine refuses it: n > 1 at temperature 0
    chat("unicode", [user("Traduis « déjà vu » en anglais, s'il te plaît. 日本語も。")], max_tokens=9),
    # Template switches in the kwargs: vLLM merges them with the request's own and runs the line (before, the count
    # raised on them: 0 tokens counted for a line the engine billed).
    chat("gen-kw", [user("Say hi.")], max_tokens=4, chat_template_kwargs={"add_generation_prompt": True}),
    chat("cont-kw", [user("Name a fruit."), assistant("An")], max_tokens=4,
         chat_template_kwargs={"continue_final_message": True}),
    # A template of the client's own: refused at its line, never rendered (it would count 5,000 words).
    chat("own", [user("Hi")], max_tokens=4, chat_template_kwargs={"chat_template": "{{ 'word ' * 5000 }}"}),
]


def test_the_estimate_counts_the_prompt_tokens_the_engine_bills(start_service, tmp_path):  # noqa: F811
    service = start_service(vllm=real_vllm(), shard_size=4)
    client = service.client()
    file_id = upload(client, tmp_path / "in.jsonl", ROWS)
    create = {"input_file_id": file_id, "endpoint": c.CHAT, "completion_window": "24h"}
    # The first estimate starts the API's count worker (vLLM's renderer, torch with it): longer than the client's
    # 30 s on a loaded 2-core machine.
    estimate = client.post("/batches/estimate", body=create, cast_to=object, options={"timeout": 300})
    assert estimate["object"] == "batch.estimate" and estimate["valid"] and estimate["refused_requests"] == 2
    assert estimate["max_output_tokens"] == 12 + 10 + 8 + 6 + 5 * 2 + 9 + 4 + 4

    batch = client.batches.create(**create)
    done = wait_for(client, batch.id, "completed", timeout_s=300)
    errors = client.files.content(done.error_file_id).text if done.error_file_id else ""
    assert done.request_counts.model_dump() == {"total": len(ROWS), "completed": len(ROWS) - 2, "failed": 2}, errors
    own = next(json.loads(line) for line in errors.splitlines() if json.loads(line)["custom_id"] == "own")
    assert own["response"]["body"]["error"]["param"] == "chat_template_kwargs"
    assert done.usage.input_tokens == estimate["input_tokens"]  # exactly
    assert 0 < done.usage.output_tokens <= estimate["max_output_tokens"]
    summary = BatchFolder(service.storage.open(), batch.id).summary()
    assert summary is not None
    assert estimate["cost"]["min"] <= summary.cost.total_cost <= estimate["cost"]["max"]
    assert estimate["cost"]["currency"] == summary.cost.currency

    # Now the model has a batch behind it: the next estimate is timed at its measured rate.
    again = client.post("/batches/estimate", body=create, cast_to=object)
    measured = summary.usage.total_tokens / summary.inference_s
    assert again["throughput_batches"] == 1 and again["tokens_per_s"] == pytest.approx(measured, abs=0.1)
    assert again["duration_s"]["min"] <= again["duration_s"]["max"]
    assert again["input_tokens"] == estimate["input_tokens"]
