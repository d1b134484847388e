"""A batch-dagster service seen from outside, over its OpenAI-compatible HTTP API: a file in, a batch created (or
found again), followed to its end, its output and error lines back. A table batch with a service's URL runs there."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from batch_dagster.batchfile.status import TERMINAL

# The metadata key a table batch is created with: its content hash, so a retried step finds the batch it created.
TABLE_BATCH_KEY = "table_batch"


class ServiceError(RuntimeError):
    """The service refused a call, or a batch ended without its files."""


@dataclass
class BatchService:
    """The service at `url` (its /v1 base, e.g. http://host:8000/v1) for the owner of `api_key`."""

    url: str
    api_key: str | None = None
    timeout_s: float = 60.0
    poll_s: float = 2.0

    def _client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url.rstrip("/"), headers=headers, timeout=self.timeout_s)

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                error = response.json().get("error") or {}
            except ValueError:
                error = {"message": response.text[:500]}
            raise ServiceError(f"{response.request.method} {response.request.url.path}: HTTP {response.status_code}"
                               f" {error.get('code') or ''} {error.get('message') or ''}".rstrip())
        return response.json()

    def find(self, tag: str) -> dict[str, Any] | None:
        """The newest batch created with `tag` that has not failed, cancelled or expired (a retried step's)."""
        with self._client() as client:
            page = self._json(client.get("/batches", params={f"metadata[{TABLE_BATCH_KEY}]": tag, "limit": 10}))
        return next((b for b in page["data"] if b["status"] not in ("failed", "cancelled", "expired")), None)

    def create(self, jsonl: bytes, filename: str, endpoint: str, tag: str,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload the requests and create their batch, tagged with `tag`; `extra`: extension fields of the body."""
        with self._client() as client:
            uploaded = self._json(client.post("/files", files={"file": (filename, jsonl)}, data={"purpose": "batch"}))
            body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h",
                    "metadata": {TABLE_BATCH_KEY: tag}, **(extra or {})}
            return self._json(client.post("/batches", json=body))

    def wait(self, batch_id: str, on_poll: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Follow the batch to its end, calling `on_poll` with each state."""
        with self._client() as client:
            while True:
                batch = self._json(client.get(f"/batches/{batch_id}"))
                if on_poll is not None:
                    on_poll(batch)
                if batch["status"] in TERMINAL:
                    return batch
                time.sleep(self.poll_s)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        with self._client() as client:
            return self._json(client.post(f"/batches/{batch_id}/cancel"))

    def lines(self, batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The lines of the batch's output file and error file."""
        with self._client() as client:
            for name in ("output_file_id", "error_file_id"):
                if not batch.get(name):
                    continue
                with client.stream("GET", f"/files/{batch[name]}/content") as response:
                    if response.status_code >= 400:
                        raise ServiceError(f"Reading {name} {batch[name]}: HTTP {response.status_code}")
                    for raw in response.iter_lines():
                        if raw.strip():
                            yield orjson.loads(raw)
