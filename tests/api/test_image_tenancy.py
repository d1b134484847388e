"""Image parts named by URL, through the service: a request is kept in the answer store by what its URL served, not by
the URL; the images a batch keeps count against its key's storage limit while it runs; the engine gets a shard's
images a bounded group of requests at a time."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response
from sqlalchemy import select

from batch_dagster.batchfile import contract as c
from batch_dagster.db import BatchRecord, Database
from batch_dagster.features import images as image_fetch
from batch_dagster.settings import Settings
from tests.helpers import FAKES, KEY_A, ApiServer, FakeVLLM, fake_body, upload, wait_for, write_jsonl

MODEL = "vlm"


class ImageEngine:
    """Answers a chat request with the hashes of the images it got (what the user reads); records each call's images
    and, when given, what `on_call` reads while the call runs."""

    def __init__(self, on_call=None):
        self.calls: list[list[str]] = []  # each call's custom_ids
        self.images: list[list[str]] = []  # each call's data URLs
        self.on_call, self.seen = on_call, []

    def run(self, endpoint, requests, on_progress=None):
        self.calls.append([cid for cid, _ in requests])
        self.images.append([])
        if self.on_call is not None:
            self.seen.append(self.on_call())
        lines = []
        for cid, body in requests:
            parts = body["messages"][-1]["content"]
            urls = [p["image_url"]["url"] for p in parts if isinstance(p, dict) and p.get("type") == "image_url"]
            self.images[-1] += urls
            saw = " ".join(hashlib.sha256(base64.b64decode(u.split(",", 1)[1])).hexdigest()[:8] for u in urls)
            lines.append(c.success_line(cid, fake_body(endpoint, body["model"], f"saw {saw}", 3, 2)))
            if on_progress is not None:
                on_progress(1)
        return lines


def registry(tmp_path: Path) -> str:
    """The project's registry and a model that takes images (its engine is the fake's)."""
    path = tmp_path / "models.toml"
    path.write_text(Settings.from_env().models_file.read_text()
                    + f'\n[models.{MODEL}]\nsource = "/nowhere"\nimages_per_request = 1\n')
    return str(path)


def images_service(start_service, tmp_path, engine, **settings):
    models = registry(tmp_path)
    FAKES[name := f"images-{tmp_path.name}"] = engine
    vllm = FakeVLLM(models_file=models, model_cache_dir="/nonexistent", fake=name)
    return start_service(vllm=vllm, engine=engine, models_file=Path(models), image_hosts=("127.0.0.1",),
                         webhook_allow=("127.0.0.1",), **settings)


def image_server(served: dict[str, bytes]) -> ApiServer:
    app = FastAPI()

    @app.get("/{name}")
    def image(name: str):
        return Response(served[name], media_type="image/png") if name in served else Response(status_code=404)

    return ApiServer(app)


def ask(custom_id: str, url: str) -> dict:
    parts = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": parts}], "temperature": 0,
                     "max_tokens": 4}}


def run(client, tmp_path, rows, name: str, **extra):
    file_id = upload(client, tmp_path / f"{name}.jsonl", rows)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body=extra)
    batch = wait_for(client, batch.id, "completed")
    lines = [json.loads(x) for fid in (batch.output_file_id, batch.error_file_id) if fid
             for x in client.files.content(fid).text.splitlines()]
    return batch, {line["custom_id"]: line for line in lines}


def answer(line: dict) -> str:
    return line["response"]["body"]["choices"][0]["message"]["content"]


def seen(data: bytes) -> str:
    return f"saw {hashlib.sha256(data).hexdigest()[:8]}"


def test_an_image_whose_url_serves_new_bytes_is_not_answered_from_the_store(start_service, tmp_path):
    engine = ImageEngine()
    client = images_service(start_service, tmp_path, engine).client(KEY_A)
    served = {"cat.png": b"\x89PNG the first cat"}
    with image_server(served) as server:
        rows = [ask("cat", f"{server.url}/cat.png")]
        _, first = run(client, tmp_path, rows, "first", reuse=True)
        assert answer(first["cat"]) == seen(served["cat.png"])
        served["cat.png"] = b"\x89PNG another cat, at the same URL"
        _, second = run(client, tmp_path, rows, "second", reuse=True)
        _, third = run(client, tmp_path, rows, "third", reuse=True)
    assert not second["cat"].get("reused") and answer(second["cat"]) == seen(served["cat.png"])
    assert len(engine.calls) == 2  # the new bytes were asked of the engine
    assert third["cat"].get("reused") is True and answer(third["cat"]) == seen(served["cat.png"])  # the same bytes


def test_the_images_a_batch_keeps_count_against_its_keys_storage_while_it_runs(start_service, tmp_path):
    images = {f"{name}.png": name.encode() * 1000 for name in ("one", "two", "six")}  # 3,000 bytes each
    kept = len(b"data:image/png;base64,") + 4000  # what each keeps in the batch's folder: its data URL
    with image_server(images) as server:
        rows = [ask(name.removesuffix(".png"), f"{server.url}/{name}") for name in images]
        size = write_jsonl(tmp_path / "size.jsonl", rows).stat().st_size
        # The upload and the batch's copy of it, and room for two of the three images.
        limit = 2 * size + 2 * kept + 1000
        store: list[Database] = []

        def batch_bytes() -> int:
            with store[0].session() as session:
                return session.scalar(select(BatchRecord.stored_bytes))

        engine = ImageEngine(on_call=batch_bytes)
        service = images_service(start_service, tmp_path, engine, shard_size=10, key_max_stored_bytes=limit)
        store.append(Database(service.config.database_url))
        batch, lines = run(service.client(KEY_A), tmp_path, rows, "three")
    answered = sorted(cid for cid, line in lines.items() if line["response"]["status_code"] == 200)
    [refused] = [line for line in lines.values() if line["response"]["status_code"] == 400]
    assert len(answered) == 2 and batch.request_counts.failed == 1
    error = refused["response"]["body"]["error"]
    assert "storage limit" in error["message"] and "BATCH_KEY_MAX_STORED_BYTES" in error["message"]
    assert error["param"] == "messages[0].content[1]"
    assert engine.seen == [size + 2 * kept]  # while the batch ran: its input copy and the two images it kept


def test_the_engine_gets_a_shards_images_a_bounded_group_at_a_time(start_service, tmp_path, monkeypatch):
    monkeypatch.setattr(image_fetch, "IN_MEMORY_BYTES", 1300, raising=False)  # 3 of the images below
    engine = ImageEngine()
    client = images_service(start_service, tmp_path, engine, shard_size=10).client(KEY_A)
    images = {f"im{i}.png": f"im{i}".encode() * 100 for i in range(5)}  # 300 bytes: a 422-byte data URL each
    with image_server(images) as server:
        _, lines = run(client, tmp_path, [ask(name, f"{server.url}/{name}") for name in images], "five")
    assert {cid: answer(line) for cid, line in lines.items()} == {name: seen(data) for name, data in images.items()}
    assert sorted(map(len, engine.calls)) == [2, 3]  # one shard, sent in two groups
    assert all(sum(map(len, urls)) <= 1300 for urls in engine.images)
