"""Images named by URL are fetched once per batch into its folder, with the webhooks' address checks, bounded (each
fetch by its size and a deadline, the batch by a budget of bytes and seconds), and reach the engine as data URLs, a
bounded group of requests at a time; a request whose image cannot be had is its own 400 line."""

from __future__ import annotations

import asyncio
import base64
import gzip
import tracemalloc

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.features import images
from batch_dagster.features.egress import Allow
from batch_dagster.features.images import ImageFetcher
from batch_dagster.storage import LocalStorage
from tests.helpers import ApiServer

PNG = b"\x89PNG fake image bytes"
LOOPBACK = Allow.parse(["127.0.0.1"])


def inline(fetcher: ImageFetcher, endpoint: str, requests: list) -> tuple[list, list]:
    """What the engine gets of `requests` (their images as data URLs, all groups together), and the refused lines."""
    ready, refused = fetcher.fetch(endpoint, requests)
    return [r for group in fetcher.inlined(endpoint, ready) for r in group], refused


def message(line: dict) -> str:
    return line["response"]["body"]["error"]["message"]


def chat(cid: str, url: str) -> tuple[str, dict]:
    parts = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]
    return cid, {"model": "vlm", "messages": [{"role": "user", "content": parts}]}


def response(cid: str, url: str) -> tuple[str, dict]:
    part = {"type": "input_image", "image_url": url}
    return cid, {"model": "vlm", "input": [{"role": "user", "content": [part]}]}


def test_images_are_fetched_once_per_batch_and_sent_as_data_urls(tmp_path):
    app, gets = FastAPI(), []

    @app.get("/{name}")
    def image(name: str):
        gets.append(name)
        if name == "note.txt":
            return Response(b"text", media_type="text/plain")
        if name == "huge.png":
            return Response(b"0" * 1000, media_type="image/png")
        return Response(PNG, media_type="image/png") if name == "cat.png" else Response(status_code=404)

    with ApiServer(app) as server:
        url = f"{server.url}/cat.png"
        folder = BatchFolder(LocalStorage(tmp_path), "batch_1")
        fetcher = ImageFetcher(folder, ImageSources.of(["127.0.0.1"], max_bytes=500), Allow.parse(["127.0.0.1"]))
        data = "data:image/png;base64," + base64.b64encode(PNG).decode()
        ready, refused = inline(fetcher, c.CHAT, [chat("a", url), chat("b", url), chat("inline", data),
                                                 chat("text", f"{server.url}/note.txt"),
                                                 chat("gone", f"{server.url}/gone.png"),
                                                 chat("huge", f"{server.url}/huge.png")])
        assert [cid for cid, _ in ready] == ["a", "b", "inline"]
        assert all(body["messages"][0]["content"][1]["image_url"]["url"] == data for _, body in ready)
        assert gets.count("cat.png") == 1
        reasons = {x["custom_id"]: x["response"]["body"]["error"] for x in refused}
        assert "not an image" in reasons["text"]["message"] and "HTTP 404" in reasons["gone"]["message"]
        assert "larger than 500 bytes" in reasons["huge"]["message"]
        assert {e["param"] for e in reasons.values()} == {"messages[0].content[1]"}
        # Another shard (or a retry) finds it in the batch folder; the responses shape too.
        again, _ = inline(fetcher, c.RESPONSES, [response("r", url)])
        assert again[0][1]["input"][0]["content"][0]["image_url"] == data and gets.count("cat.png") == 1
        # Loopback is no public address: without the operator's allow-list the fetch is refused.
        strict = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "batch_2"), ImageSources.of(["127.0.0.1"], 500),
                              Allow())
        _, [line] = strict.fetch(c.CHAT, [chat("a", url)])
        assert "not at a public address" in line["response"]["body"]["error"]["message"]
        assert gets.count("cat.png") == 1


def test_an_image_trickled_byte_by_byte_is_cut_at_the_fetch_deadline(tmp_path):
    """Each read comes well within the timeout, the whole never does: the fetch's deadline ends it."""
    app = FastAPI()

    @app.get("/slow.png")
    def slow():
        async def trickle():
            for _ in range(100):  # 100 bytes over 5 s
                yield b"x"
                await asyncio.sleep(0.05)
        return StreamingResponse(trickle(), media_type="image/png")

    with ApiServer(app) as server:
        fetcher = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "b"), ImageSources.of(["127.0.0.1"], 1000),
                               LOOPBACK, timeout_s=1)
        ready, refused = fetcher.fetch(c.CHAT, [chat("slow", f"{server.url}/slow.png")])
    assert ready == [] and [line["custom_id"] for line in refused] == ["slow"]
    assert "did not arrive within 1 s" in message(refused[0])
    assert refused[0]["response"]["body"]["error"]["param"] == "messages[0].content[1]"


def test_a_gzip_bomb_is_decompressed_a_bounded_piece_at_a_time(tmp_path):
    """64 KiB of gzip that make 64 MiB: refused past BATCH_MAX_IMAGE_BYTES, never held whole (httpx's own decoder
    makes each received chunk's whole output at once)."""
    bomb = gzip.compress(bytes(64 << 20), compresslevel=9)
    assert len(bomb) < 100_000
    app = FastAPI()

    @app.get("/bomb.png")
    def served():
        return Response(bomb, media_type="image/png", headers={"content-encoding": "gzip"})

    @app.get("/small.png")
    def small():
        return Response(gzip.compress(PNG), media_type="image/png", headers={"content-encoding": "gzip"})

    with ApiServer(app) as server:
        fetcher = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "b"), ImageSources.of(["127.0.0.1"], 1 << 20),
                               LOOPBACK)
        tracemalloc.start()
        try:
            ready, refused = fetcher.fetch(c.CHAT, [chat("bomb", f"{server.url}/bomb.png"),
                                                    chat("small", f"{server.url}/small.png")])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        [got] = fetcher.inlined(c.CHAT, ready)
    assert [line["custom_id"] for line in refused] == ["bomb"] and "larger than 1048576 bytes" in message(refused[0])
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB at the peak"
    # A gzipped image that fits is decompressed whole, as sent.
    assert got[0][1]["messages"][0]["content"][1]["image_url"]["url"] == \
        "data:image/png;base64," + base64.b64encode(PNG).decode()


def test_a_batch_fetches_within_one_budget_of_bytes_and_seconds(tmp_path):
    """The batch's fetches share BATCH_IMAGE_BUDGET_BYTES and BATCH_IMAGE_BUDGET_S, across shards: past either, a
    request naming an image not fetched yet is its 400 line, saying which."""
    app = FastAPI()

    @app.get("/{name}.png")
    async def image(name: str):
        if name == "late":
            await asyncio.sleep(3)
        return Response(bytes(600), media_type="image/png")

    with ApiServer(app) as server:
        sources = ImageSources.of(["127.0.0.1"], 1000)
        fetcher = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "b"), sources, LOOPBACK, budget_bytes=1000)
        asked = {name: chat(name, f"{server.url}/{name}.png") for name in ("a", "b")}
        ready, refused = fetcher.fetch(c.CHAT, list(asked.values()))
        assert len(ready) == len(refused) == 1  # 600 bytes each: one fits the 1,000
        assert "BATCH_IMAGE_BUDGET_BYTES" in message(refused[0])
        [(fetched, _)] = ready
        # The next shard (another fetcher of the same batch, as a retry's) finds the budget spent.
        again = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "b"), sources, LOOPBACK, budget_bytes=1000)
        ready, [line] = again.fetch(c.CHAT, [chat("c", f"{server.url}/c.png"), asked[fetched]])
        assert line["custom_id"] == "c" and "BATCH_IMAGE_BUDGET_BYTES" in message(line)
        assert [cid for cid, _ in ready] == [fetched]  # an image the batch has needs no budget

        slow = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "s"), sources, LOOPBACK, budget_s=1)
        _, [line] = slow.fetch(c.CHAT, [chat("late", f"{server.url}/late.png")])
        assert "BATCH_IMAGE_BUDGET_S" in message(line)
        _, [line] = slow.fetch(c.CHAT, [chat("next", f"{server.url}/a.png")])  # spent: refused without a fetch
        assert "BATCH_IMAGE_BUDGET_S" in message(line)


def test_the_engine_gets_a_shards_images_a_bounded_group_at_a_time(tmp_path, monkeypatch):
    app = FastAPI()

    @app.get("/{name}.png")
    def image(name: str):
        return Response(name.encode() * 100, media_type="image/png")

    monkeypatch.setattr(images, "IN_MEMORY_BYTES", 1300)
    with ApiServer(app) as server:
        fetcher = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "b"), ImageSources.of(["127.0.0.1"], 1000),
                               LOOPBACK)
        names = ["im1", "im2", "im3", "im4", "im5"]
        requests = [chat(name, f"{server.url}/{name}.png") for name in names] + [("text", {"messages": []})]
        ready, refused = fetcher.fetch(c.CHAT, requests)
        assert refused == [] and all(images.STORED in str(body) for _, body in ready[:5])
        groups = list(fetcher.inlined(c.CHAT, ready))
    urls = [[body["messages"][0]["content"][1]["image_url"]["url"] for _, body in group if body["messages"]]
            for group in groups]
    assert [len(group) for group in urls] == [3, 2]  # each image's data URL is 422 bytes: 3 fit in 1,300
    assert all(sum(map(len, group)) <= 1300 for group in urls)
    assert [cid for group in groups for cid, _ in group] == [*names, "text"]  # in their order, every one
    assert [base64.b64decode(u.split(",", 1)[1]) for g in urls for u in g] == [n.encode() * 100 for n in names]


def test_a_request_cannot_name_a_kept_image_itself(tmp_path):
    """The name a kept image has in a body until it is sent is ours: a request that writes one is its 400 line (as
    validation reported it), never given another request's image."""
    app = FastAPI()

    @app.get("/cat.png")
    def cat():
        return Response(PNG, media_type="image/png")

    with ApiServer(app) as server:
        fetcher = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "b"), ImageSources.of(["127.0.0.1"], 1000),
                               LOOPBACK)
        ready, _ = fetcher.fetch(c.CHAT, [chat("cat", f"{server.url}/cat.png")])
        ours = ready[0][1]["messages"][0]["content"][1]["image_url"]["url"]
        ready, [line] = fetcher.fetch(c.CHAT, [chat("forged", ours)])
    assert ready == [] and line["custom_id"] == "forged" and "data URL or an http(s) URL" in message(line)
    assert line["response"]["body"]["error"]["param"] == "messages[0].content[1]"
