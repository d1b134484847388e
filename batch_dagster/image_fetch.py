"""Image parts named by http(s) URL: fetched once per batch and sent to the engine as data URLs.

A fetch goes only to a host the operator allows (BATCH_IMAGE_HOSTS; validation checked it too), at an address the
webhooks' checks admit (public, or BATCH_WEBHOOK_ALLOW; the connection pinned to it), follows no redirect and reads at
most BATCH_MAX_IMAGE_BYTES of an `image/*` answer. Each image is kept in the batch's folder as its data URL, so a
retried shard, or another shard naming it, fetches nothing. A request whose image cannot be fetched is its own 400
line; the engine itself fetches nothing.
"""

from __future__ import annotations

import asyncio
import base64
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import image_sources
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.egress import Allow, Refused, pinned

Request = tuple[str, dict[str, Any]]
TIMEOUT_S = 30.0
CONCURRENCY = 8  # fetches at once


def _image_slots(endpoint: str, body: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str, str]]:
    """(holder, key, param) of each image part's URL: `holder[key]` is the URL, `param` where it is."""
    if endpoint == c.CHAT:
        for i, message in enumerate(body.get("messages") or []):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                holder = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
                if isinstance(holder, dict):
                    yield holder, "url", f"messages[{i}].content[{j}]"
    elif endpoint == c.RESPONSES and isinstance(body.get("input"), list):
        for i, item in enumerate(body["input"]):
            content = item.get("content") if isinstance(item, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    yield part, "image_url", f"input[{i}].content[{j}]"


def fetched_urls(endpoint: str, body: dict[str, Any]) -> list[str]:
    """The http(s) URLs of a body's image parts (data URLs need no fetch)."""
    return [url for holder, key, _ in _image_slots(endpoint, body)
            if isinstance(url := holder.get(key), str) and url[:4].lower() == "http"]


@dataclass
class ImageFetcher:
    """Fetches a batch's images into its folder, once each."""

    folder: BatchFolder
    sources: ImageSources
    allow: Allow
    timeout_s: float = TIMEOUT_S

    def inline(self, endpoint: str, requests: Sequence[Request]) -> tuple[list[Request], list[dict[str, Any]]]:
        """The requests with their fetched images as data URLs (what the engine gets), and an error line for each
        request an image of which could not be had."""
        urls = sorted({url for _, body in requests for url in fetched_urls(endpoint, body)})
        if not urls:
            return list(requests), []
        got = asyncio.run(self._all(urls))
        ready, refused = [], []
        for custom_id, body in requests:
            body = copy.deepcopy(body) if fetched_urls(endpoint, body) else body
            problem = None
            for holder, key, param in _image_slots(endpoint, body):
                url = holder.get(key)
                if isinstance(url, str) and url in got:
                    data, why = got[url]
                    if data is None:
                        problem = (f"The image {c.quoted(url)} could not be fetched: {why}", param)
                        break
                    holder[key] = data
            if problem is None:
                ready.append((custom_id, body))
            else:
                refused.append(c.request_error_line(custom_id, c.INVALID_REQUEST, problem[0], param=problem[1]))
        return ready, refused

    async def _all(self, urls: list[str]) -> dict[str, tuple[str | None, str]]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:

            async def one(url: str) -> tuple[str | None, str]:
                key = self.folder.image_key(url)
                kept = await asyncio.to_thread(self.folder.storage.read_bytes, key)
                if kept is not None:
                    return kept.decode(), ""
                async with gate:
                    data, why = await self._fetch(client, url)
                if data is not None:
                    await asyncio.to_thread(self.folder.storage.write_bytes, key, data.encode())
                return data, why

            answers = await asyncio.gather(*(one(url) for url in urls))
        return dict(zip(urls, answers, strict=True))

    async def _fetch(self, client: httpx.AsyncClient, url: str) -> tuple[str | None, str]:
        """The image at `url` as a data URL, or None and why not."""
        why = image_sources.refusal(url, self.sources)  # the host, again: the policy may have changed since
        if why is not None:
            return None, why
        try:
            target, extensions = await pinned(httpx.URL(url), self.allow)
            headers = {"host": httpx.URL(url).netloc.decode("ascii")}
            async with client.stream("GET", target, headers=headers, extensions=extensions) as response:
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if response.status_code != 200:
                    return None, f"HTTP {response.status_code}"
                if not kind.startswith("image/"):
                    return None, f"its content type is {c.quoted(kind)}, not an image"
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > self.sources.max_bytes:
                        return None, f"it is larger than {self.sources.max_bytes} bytes (BATCH_MAX_IMAGE_BYTES)"
        except Refused as exc:
            return None, str(exc)
        except (httpx.HTTPError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {str(exc)[:200]}"
        return f"data:{kind};base64,{base64.b64encode(bytes(data)).decode()}", ""
