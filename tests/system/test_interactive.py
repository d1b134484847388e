"""One base URL for interactive and batch calls, for real: the API forwards interactive calls through serve's own
vllm-router (its cache_salt reaching the replicas, a fleet in use kept warm, a sleeping one woken by a call), and the
official `openai` SDK, one client object, talks to `make serve` for chat, a stream, /v1/responses, embeddings and a
batch on the real engine, the interactive answers the router's own. (tests/api/test_interactive.py: the rules, on a
fake router.)"""

from __future__ import annotations

import base64
import json
import struct
import time
from dataclasses import replace

import httpx
import pytest

from batch_dagster.api.app import create_app
from batch_dagster.db import Database
from batch_dagster.db.fleets import fleet_records
from batch_dagster.db.repo import owner_of_key
from batch_dagster.engine.budget import ServerMetrics
from batch_dagster.features.scope import cache_salt
from batch_dagster.serve.fleets import WarmFleets
from batch_dagster.settings import LOOPBACK, Settings
from tests.helpers import CHAT_MODEL, EMBED_MODEL, SERVE_API_KEY, ApiServer, Serve, chat_request, write_jsonl
from tests.system.test_fleets import stand_in_fleets, tick_until

KEY = "sk-interactive"


def test_calls_reach_the_replicas_through_the_real_router_salted_and_keep_or_wake_their_fleet(tmp_path):
    settings = replace(Settings.from_env(), data_dir=tmp_path / "data", storage_url=str(tmp_path / "data"),
                       database_url=f"sqlite:///{tmp_path / 'store.db'}", api_keys=(KEY,), fleet_replicas=1,
                       fleet_port=0, fleet_idle_s=4.0, fleet_urls={})
    store = Database(settings.database_url)
    store.upgrade()
    fleets = WarmFleets.plan(settings, [CHAT_MODEL, EMBED_MODEL], host=LOOPBACK, store=store, gpus=[],
                             make=stand_in_fleets(tmp_path))
    try:
        fleets.start(should_stop=lambda: False)
        with ApiServer(create_app(settings)) as api:
            http = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            salt = cache_salt(f"owner:{owner_of_key(KEY)}", "")
            bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
                      "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}
            for endpoint, body in bodies.items():
                answer = http.post(endpoint, json={"model": CHAT_MODEL, **body})
                assert answer.status_code == 200, answer.text
                assert answer.json()["got"]["cache_salt"] == salt  # through vllm-router to the replica
            # vllm-router re-types embeddings and drops cache_salt: why embeddings are refused from servers that
            # keep a prefix cache (these stand-ins say they keep none).
            embedded = http.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "hi"})
            assert embedded.status_code == 200 and "cache_salt" not in embedded.json()["got"]

            # Calls, and no batch, keep the chat fleet warm past its idle time; the embeddings fleet sleeps. (An idle
            # time of some seconds: a loaded machine's call may take one.)
            deadline = time.monotonic() + 14
            while time.monotonic() < deadline:
                assert http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": "hi"}).status_code == 200
                fleets.tick()
                time.sleep(0.5)
            chat, embed = fleets.fleets[CHAT_MODEL], fleets.fleets[EMBED_MODEL]
            assert not chat.asleep and embed.asleep
            time.sleep(1.1)  # the API reads the fleets' states again
            asleep = http.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "hi"})
            assert asleep.status_code == 503 and int(asleep.headers["retry-after"]) >= 1
            def woke() -> bool:
                with store.session() as session:
                    return not embed.asleep and fleet_records(session)[EMBED_MODEL].state == "warm"

            tick_until(fleets, woke)  # the call woke it
            deadline = time.monotonic() + 30
            while (again := http.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "x"})).status_code != 200:
                assert time.monotonic() < deadline, again.text
                time.sleep(0.5)
    finally:
        fleets.stop()
        store.dispose()


def _floats(data: str) -> list[float]:
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_one_openai_client_makes_interactive_and_batch_calls_to_serve_on_the_real_engine(tmp_path):
    env = {"BATCH_FLEET_REPLICAS": "1", "BATCH_FLEET_MODELS": f"{CHAT_MODEL},{EMBED_MODEL}", "BATCH_FLEET_IDLE_S": "0"}
    with Serve(tmp_path, **env) as serve:
        client = serve.client().with_options(timeout=120)  # one client object for everything below
        deadline = time.time() + 420
        while {m.id: m.model_extra["fleet"] for m in client.models.list()} != {CHAT_MODEL: "warm", EMBED_MODEL: "warm"}:
            assert time.time() < deadline and serve.proc.poll() is None, serve.logs()
            time.sleep(2)
        with serve.store() as session:
            routers = {model: f.url for model, f in fleet_records(session).items()}
        router = httpx.Client(timeout=120)
        salt = cache_salt(f"owner:{owner_of_key(SERVE_API_KEY)}", "")

        def routers_answer(model: str, endpoint: str, body: dict) -> dict:
            """What the model's router answers to the body the API sends it (the same, with the key's salt)."""
            return router.post(routers[model] + endpoint, json={**body, "cache_salt": salt}).json()

        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        asked = {"model": CHAT_MODEL, "messages": messages, "temperature": 0, "max_tokens": 24}
        raw = client.chat.completions.with_raw_response.create(**asked)
        chat = raw.parse()
        mine, direct = json.loads(raw.http_response.content), routers_answer(CHAT_MODEL, "/v1/chat/completions", asked)
        for body in (mine, direct):
            del body["id"], body["created"]
        assert mine == direct  # the router's answer, but for its id and time
        answer = chat.choices[0].message.content
        assert answer and "Paris" in answer, answer

        # Streamed: the same answer, in several events.
        events = list(client.chat.completions.create(model=CHAT_MODEL, messages=messages, temperature=0,
                                                     max_tokens=24, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == answer
        assert len(events) > 3 and events[-1].usage.completion_tokens == chat.usage.completion_tokens

        reply = client.responses.create(model=CHAT_MODEL, input="Name a primary colour.", temperature=0,
                                        max_output_tokens=16)
        direct = routers_answer(CHAT_MODEL, "/v1/responses", {"model": CHAT_MODEL, "input": "Name a primary colour.",
                                                              "temperature": 0, "max_output_tokens": 16})
        texts = [c["text"] for item in direct["output"] if item["type"] == "message" for c in item["content"]]
        assert reply.output_text and [reply.output_text] == texts

        vectors = client.embeddings.create(model=EMBED_MODEL, input=["The cat sat on the mat."])
        direct = router.post(routers[EMBED_MODEL] + "/v1/embeddings", json={
            "model": EMBED_MODEL, "input": ["The cat sat on the mat."], "encoding_format": "base64"}).json()
        assert len(vectors.data[0].embedding) == 384
        assert vectors.data[0].embedding == pytest.approx(_floats(direct["data"][0]["embedding"]), abs=1e-6)

        # The batch budget's view of the servers (engine/budget.py): an interactive stream in flight is a request
        # the chat fleet's replica holds.
        async def running() -> float:
            async with httpx.AsyncClient() as c:
                reading = await ServerMetrics(c, [routers[CHAT_MODEL]]).read()
                assert reading is not None
                return reading.running + reading.waiting

        import asyncio

        long = client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Tell a long "
                                              "story."}], max_tokens=400, stream=True)
        next(iter(long))
        assert asyncio.run(running()) >= 1
        long.close()

        # A batch, with the same client.
        rows = [chat_request("capital", messages[0]["content"], max_tokens=24, temperature=0)]
        with open(write_jsonl(tmp_path / "batch.jsonl", rows), "rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        done = serve.wait_for(batch.id, {"completed", "failed"}, 300)
        assert done.status == "completed", serve.logs()
        [line] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert "Paris" in line["response"]["body"]["choices"][0]["message"]["content"]

        text = httpx.get(f"http://127.0.0.1:{serve.metrics_port}/metrics", timeout=10).text
        assert f'model="{CHAT_MODEL}",status="200"' in text and f'model="{EMBED_MODEL}",status="200"' in text
