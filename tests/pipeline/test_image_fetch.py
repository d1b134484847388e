"""Images named by URL are fetched once per batch into its folder, with the webhooks' address checks, bounded, and
reach the engine as data URLs; a request whose image cannot be had is its own 400 line."""

from __future__ import annotations

import base64

from fastapi import FastAPI
from fastapi.responses import Response

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.egress import Allow
from batch_dagster.image_fetch import ImageFetcher
from batch_dagster.storage import LocalStorage
from tests.helpers import ApiServer

PNG = b"\x89PNG fake image bytes"


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
        ready, refused = fetcher.inline(c.CHAT, [chat("a", url), chat("b", url), chat("inline", data),
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
        again, _ = fetcher.inline(c.RESPONSES, [response("r", url)])
        assert again[0][1]["input"][0]["content"][0]["image_url"] == data and gets.count("cat.png") == 1
        # Loopback is no public address: without the operator's allow-list the fetch is refused.
        strict = ImageFetcher(BatchFolder(LocalStorage(tmp_path), "batch_2"), ImageSources.of(["127.0.0.1"], 500),
                              Allow())
        _, [line] = strict.inline(c.CHAT, [chat("a", url)])
        assert "not at a public address" in line["response"]["body"]["error"]["message"]
        assert gets.count("cat.png") == 1
