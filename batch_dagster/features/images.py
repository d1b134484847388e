"""Image parts named by http(s) URL: fetched once per batch into its folder, and sent to the engine as data URLs.

A fetch goes only to a host the operator allows (BATCH_IMAGE_HOSTS; validation checked it too), at an address the
webhooks' checks admit (public, or BATCH_WEBHOOK_ALLOW; the connection pinned to it), follows no redirect, and reads
at most BATCH_MAX_IMAGE_BYTES of an `image/*` answer, decompressed a bounded piece at a time, all within TIMEOUT_S.
A batch's fetches share one budget of bytes and seconds (BATCH_IMAGE_BUDGET_BYTES, BATCH_IMAGE_BUDGET_S), and each
image kept counts against its key's stored bytes from then on. An image is streamed into the batch's folder as its
data URL, so a retried shard, or another shard naming it, fetches nothing. Until it is sent, a request names a kept
image by the hash of its content (what the answer store keys the request by); the engine then gets the requests a
group at a time, each group's images read from the folder, so a shard's images are never all in memory. A request
whose image cannot be had is its own 400 line; the engine itself fetches nothing.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import os
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import orjson

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import image_sources
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.features.egress import Allow, Refused, pinned
from batch_dagster.features.shards import Line, Request, Run, Shard, ShardFeature
from batch_dagster.settings import default

TIMEOUT_S = 30.0  # one fetch, whole: the connection, the answer's head and every byte of its body
CONCURRENCY = 8  # fetches at once
PIECE = 1 << 20  # the most bytes one step of decompression makes
IN_MEMORY_BYTES = 64 << 20  # the data URLs of one group of requests sent to the engine (a larger image goes alone)
# A kept image's name in a body until it is sent: no client can write one (validation takes data and http(s) URLs).
STORED = "batch-image:sha256:"
_KIND = re.compile(r"image/[a-z0-9.+-]+")  # a content type a data URL can carry (image_sources checks the same)


@dataclass(frozen=True)
class Kept:
    """An image kept in the batch's folder: where its data URL is, the SHA-256 of that data URL, and its size."""

    key: str
    sha256: str
    size: int


class _Budget:
    """What the batch's fetches may still spend: its bytes (decompressed, as read) and seconds, counted from what the
    earlier shards' fetches spent (`spent`: bytes, seconds)."""

    def __init__(self, spent: dict[str, Any], max_bytes: int, max_s: float):
        self.before_bytes, self.before_s = int(spent.get("bytes", 0)), float(spent.get("seconds", 0.0))
        self.max_bytes, self.max_s = max_bytes, max_s
        self.bytes, self.started = 0, time.monotonic()

    def bytes_left(self) -> int:
        return self.max_bytes - self.before_bytes - self.bytes

    def seconds_left(self) -> float:
        return self.max_s - self.before_s - (time.monotonic() - self.started)

    def spent(self) -> dict[str, Any]:
        return {"bytes": self.before_bytes + self.bytes, "seconds": self.before_s + time.monotonic() - self.started}


class _Decoder:
    """An answer's content encoding undone a bounded piece at a time: httpx's own decoders make one chunk's whole
    output at once, and 64 KiB of gzip make 64 MiB."""

    def __init__(self, encoding: str):
        encoding = encoding.strip().lower()
        if encoding in ("", "identity"):
            self._z = None
        elif encoding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._z = zlib.decompressobj()
        else:
            raise ValueError(f"its content encoding {c.quoted(encoding)} is not one taken (gzip, deflate)")

    def decode(self, data: bytes) -> Iterator[bytes]:
        if self._z is None:
            if data:
                yield data
            return
        while data and not self._z.eof:
            piece = self._z.decompress(data, PIECE)
            if piece:
                yield piece
            elif self._z.unconsumed_tail == data:
                break  # no progress: nothing more comes of this input
            data = self._z.unconsumed_tail

    def flush(self) -> Iterator[bytes]:
        rest = self._z.flush() if self._z is not None else b""
        if rest:
            yield rest


class _DataUrl:
    """An image's bytes written into `out` as a data URL, in base64 a piece at a time, and the SHA-256 of the data URL
    (what names the image in the answer store's keys)."""

    def __init__(self, out: BinaryIO, kind: str):
        self.out, self.hash, self.bytes, self._rest = out, hashlib.sha256(), 0, b""
        self._write(f"data:{kind};base64,".encode())

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.hash.update(data)

    def write(self, piece: bytes) -> None:
        self.bytes += len(piece)
        data = self._rest + piece
        cut = len(data) - len(data) % 3  # base64 of whole 3-byte groups: the pieces' base64 joins into the whole's
        self._write(base64.b64encode(data[:cut]))
        self._rest = data[cut:]

    def close(self) -> None:
        self._write(base64.b64encode(self._rest))
        self._rest = b""


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


def _stored(endpoint: str, body: dict[str, Any]) -> list[str]:
    """The hashes of the kept images a body names."""
    return [url[len(STORED):] for holder, key, _ in _image_slots(endpoint, body)
            if isinstance(url := holder.get(key), str) and url.startswith(STORED)]


@dataclass
class ImageFetcher:
    """Fetches a batch's images into its folder, once each, within the batch's budget; hands them to the engine a
    bounded group of requests at a time. `keep` counts the bytes of an image about to be kept against its key's
    storage: None when they fit (and are counted), else why not."""

    folder: BatchFolder
    sources: ImageSources
    allow: Allow
    timeout_s: float = TIMEOUT_S
    budget_bytes: int = default("BATCH_IMAGE_BUDGET_BYTES")
    budget_s: float = default("BATCH_IMAGE_BUDGET_S")
    keep: Callable[[int], str | None] | None = None
    kept: dict[str, Kept] = field(default_factory=dict, init=False)  # the images named so far, by their hash

    def fetch(self, endpoint: str, requests: Sequence[Request]) -> tuple[list[Request], list[dict[str, Any]]]:
        """The requests with each image URL replaced by the kept image's name (`STORED` and its hash), and an error
        line for each request an image of which could not be had."""
        urls = sorted({url for _, body in requests for url in fetched_urls(endpoint, body)})
        got = asyncio.run(self._all(urls)) if urls else {}
        ready, refused = [], []
        for custom_id, body in requests:
            body = copy.deepcopy(body) if fetched_urls(endpoint, body) else body
            problem = None
            for holder, key, param in _image_slots(endpoint, body):
                url = holder.get(key)
                if isinstance(url, str) and url.startswith(STORED):  # a client's, never ours: not a URL it may send
                    problem = (str(image_sources.refusal(url, None)), param)
                    break
                if isinstance(url, str) and url in got:
                    kept, why = got[url]
                    if kept is None:
                        problem = (f"The image {c.quoted(url)} could not be fetched: {why}", param)
                        break
                    holder[key] = STORED + kept.sha256
            if problem is None:
                ready.append((custom_id, body))
            else:
                refused.append(c.request_error_line(custom_id, c.INVALID_REQUEST, problem[0], param=problem[1]))
        return ready, refused

    def inlined(self, endpoint: str, requests: Sequence[Request]) -> Iterator[list[Request]]:
        """The requests in groups, in their order, each request with its kept images as data URLs: a group's images
        hold at most IN_MEMORY_BYTES (a request whose images alone hold more is a group of its own)."""
        group: list[Request] = []
        size = 0
        for request in requests:
            need = sum(self.kept[h].size for h in _stored(endpoint, request[1]))
            if group and size + need > IN_MEMORY_BYTES:
                yield self._with_images(endpoint, group)
                group, size = [], 0
            group.append(request)
            size += need
        if group:
            yield self._with_images(endpoint, group)

    def _with_images(self, endpoint: str, group: list[Request]) -> list[Request]:
        data: dict[str, str] = {}  # each image read once per group, whatever the requests naming it
        out = []
        for custom_id, body in group:
            if _stored(endpoint, body):
                body = copy.deepcopy(body)
                for holder, key, _ in _image_slots(endpoint, body):
                    url = holder.get(key)
                    if isinstance(url, str) and url.startswith(STORED):
                        name = url[len(STORED):]
                        if name not in data:
                            kept = self.folder.storage.read_bytes(self.kept[name].key)
                            if kept is None:  # the folder lost it since: the step's retry fetches it again
                                raise RuntimeError(f"The kept image {self.kept[name].key} is gone")
                            data[name] = kept.decode()
                        holder[key] = data[name]
            out.append((custom_id, body))
        return out

    def _record(self, url: str) -> Kept | None:
        """The image `url` names, if the batch has it already (its record is written after it)."""
        data = self.folder.storage.read_bytes(self.folder.image_record_key(url))
        if data is None:
            return None
        record = orjson.loads(data)
        return Kept(self.folder.image_key(url), record["sha256"], record["size"])

    async def _all(self, urls: list[str]) -> dict[str, tuple[Kept | None, str]]:
        spent = self.folder.storage.read_bytes(self.folder.images_spent_key)
        budget = _Budget(orjson.loads(spent) if spent else {}, self.budget_bytes, self.budget_s)
        gate = asyncio.Semaphore(CONCURRENCY)
        fetched = False
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:

            async def one(url: str) -> tuple[Kept | None, str]:
                nonlocal fetched
                kept = await asyncio.to_thread(self._record, url)
                if kept is not None:
                    return kept, ""
                async with gate:
                    fetched = True
                    return await self._fetch(client, url, budget)

            answers = await asyncio.gather(*(one(url) for url in urls))
        if fetched:
            self.folder.storage.write_bytes(self.folder.images_spent_key, orjson.dumps(budget.spent()))
        self.kept.update({kept.sha256: kept for kept, _ in answers if kept is not None})
        return dict(zip(urls, answers, strict=True))

    async def _fetch(self, client: httpx.AsyncClient, url: str, budget: _Budget) -> tuple[Kept | None, str]:
        """The image at `url`, kept in the batch's folder, or None and why not."""
        why = image_sources.refusal(url, self.sources)  # the host, again: the policy may have changed since
        if why is not None:
            return None, why
        if budget.bytes_left() <= 0:
            return None, f"the batch has fetched its {self.budget_bytes} bytes of images (BATCH_IMAGE_BUDGET_BYTES)"
        deadline = min(self.timeout_s, budget.seconds_left())
        if deadline <= 0:
            return None, f"the batch has spent its {self.budget_s:g} s of fetching images (BATCH_IMAGE_BUDGET_S)"
        try:
            async with asyncio.timeout(deadline):
                return await self._download(client, url, budget)
        except TimeoutError:
            if deadline < self.timeout_s:
                return None, f"the batch has spent its {self.budget_s:g} s of fetching images (BATCH_IMAGE_BUDGET_S)"
            return None, f"it did not arrive within {deadline:g} s"
        except Refused as exc:
            return None, str(exc)
        except (httpx.HTTPError, ValueError, zlib.error) as exc:
            return None, f"{type(exc).__name__}: {str(exc)[:200]}"

    async def _download(self, client: httpx.AsyncClient, url: str, budget: _Budget) -> tuple[Kept | None, str]:
        target, extensions = await pinned(httpx.URL(url), self.allow)
        headers = {"host": httpx.URL(url).netloc.decode("ascii"), "accept-encoding": "gzip, deflate"}
        async with client.stream("GET", target, headers=headers, extensions=extensions) as response:
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if response.status_code != 200:
                return None, f"HTTP {response.status_code}"
            if not _KIND.fullmatch(kind):
                return None, f"its content type is {c.quoted(kind)}, not an image"
            decoder = _Decoder(response.headers.get("content-encoding", ""))
            handle, name = tempfile.mkstemp(prefix="batch-image-")
            path = Path(name)
            try:
                with os.fdopen(handle, "wb") as out:
                    image = _DataUrl(out, kind)
                    async for raw in response.aiter_raw():
                        for piece in decoder.decode(raw):
                            if why := self._take(image, piece, budget):
                                return None, why
                    for piece in decoder.flush():
                        if why := self._take(image, piece, budget):
                            return None, why
                    image.close()
                return await self._keep(url, path, image.hash.hexdigest())
            finally:
                path.unlink(missing_ok=True)

    def _take(self, image: _DataUrl, piece: bytes, budget: _Budget) -> str | None:
        """Write the next decompressed piece of an image, or why it is refused (counted either way: it was read)."""
        budget.bytes += len(piece)
        if image.bytes + len(piece) > self.sources.max_bytes:
            return f"it is larger than {self.sources.max_bytes} bytes (BATCH_MAX_IMAGE_BYTES)"
        if budget.bytes_left() < 0:
            return f"the batch has fetched its {self.budget_bytes} bytes of images (BATCH_IMAGE_BUDGET_BYTES)"
        image.write(piece)
        return None

    async def _keep(self, url: str, path: Path, sha256: str) -> tuple[Kept | None, str]:
        """The fetched image, counted against its key's storage, then kept in the batch's folder, then its record."""
        size = path.stat().st_size
        if self.keep is not None and (why := self.keep(size)):
            return None, why
        kept = Kept(self.folder.image_key(url), sha256, size)
        await asyncio.to_thread(self.folder.storage.put_file, kept.key, path)
        record = orjson.dumps({"sha256": sha256, "size": size})
        await asyncio.to_thread(self.folder.storage.write_bytes, self.folder.image_record_key(url), record)
        return kept, ""


class FetchImages(ShardFeature):
    """A shard's image URLs fetched (once per batch) before anything else looks at its requests, which from then on
    name each image by its content's hash (what the answer store keys them by); a request whose image cannot be had
    is its own 400 line."""

    def __init__(self, fetcher: ImageFetcher, endpoint: str):
        self.fetcher, self.endpoint = fetcher, endpoint

    def run(self, shard: Shard, requests: list[Request], then: Run) -> list[Line]:
        fetched, unfetched = self.fetcher.fetch(self.endpoint, requests)
        if unfetched:
            shard.progress(len(unfetched))
        return then(fetched) + unfetched


class SendImages(ShardFeature):
    """The requests handed to the engine a bounded group at a time, each with its images as data URLs (the last of a
    batch's features: nothing after it holds the images)."""

    def __init__(self, fetcher: ImageFetcher, endpoint: str):
        self.fetcher, self.endpoint = fetcher, endpoint

    def run(self, shard: Shard, requests: list[Request], then: Run) -> list[Line]:
        return [line for group in self.fetcher.inlined(self.endpoint, requests) for line in then(group)]
