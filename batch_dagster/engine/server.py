"""The server engine: requests sent concurrently, within a budget (engine/budget.py), to OpenAI-compatible vLLM
servers."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.shard import features
from batch_dagster.settings import default

from . import translate as t
from .base import EngineCrash, Line, OnProgress, Request
from .budget import Budget, recomputed

log = logging.getLogger(__name__)

_ATTEMPTS = 3  # answers of 500 before a request's error line
# What a router (or a proxy) answers when no healthy server can take the request: the request is resent.
_SERVER_AWAY = {502, 503, 504}
# A server asking for less (rate limited; vLLM's 503 when its queue is full): the request waits and is sent again.
_BUSY = {429, 503}


def _error_line(custom_id: str, status: int, payload: Any) -> Line:
    """An error line from a server's error response, in the batch contract's shape."""
    err = payload.get("error", payload) if isinstance(payload, dict) else {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    message = str(err.get("message") or payload)
    if status >= 500:
        return c.request_error_line(custom_id, c.ENGINE_ERROR, message, status_code=status)
    code = c.CONTEXT_LENGTH_EXCEEDED if "maximum context length" in message else c.INVALID_REQUEST
    param = err.get("param")
    # A body the server's schema refuses (422 from FastAPI's validation) is a bad request all the same.
    return c.request_error_line(custom_id, code, message, param=param if isinstance(param, str) else None,
                                status_code=400 if status == 422 else status)


def server_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body as a vLLM server takes it: template switches moved into chat_template_kwargs."""
    if endpoint != c.CHAT or "enable_thinking" not in body:
        return body
    out = {k: v for k, v in body.items() if k != "enable_thinking"}
    out["chat_template_kwargs"] = t.chat_template_kwargs(body)
    return out


@dataclass
class ServerEngine:
    """Runs shards against one or more vLLM servers (`base_urls` end before `/v1`)."""

    base_urls: Sequence[str]
    max_concurrency: int = default("BATCH_VLLM_MAX_CONCURRENCY")
    timeout_s: float = 600.0
    api_key: str | None = None
    failover_s: float = 120.0  # how long requests are resent while no server answers
    budget: str = default("BATCH_VLLM_BUDGET")  # "fixed": max_concurrency in flight; "adaptive": engine/budget.py

    def run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None = None) -> list[Line]:
        return asyncio.run(self._run(endpoint, requests, on_progress))

    async def _run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None) -> list[Line]:
        if not self.base_urls:
            raise EngineCrash("Server mode needs at least one server URL.")
        urls = [u.rstrip("/") + endpoint for u in self.base_urls]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.max_concurrency + 4)  # and the budget's readings of the servers
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers, limits=limits) as client, \
                recomputed(Budget(self.max_concurrency, adaptive=self.budget == "adaptive"), client,
                           self.base_urls) as budget:

            async def one(custom_id: str, body: dict[str, Any], first: int) -> Line:
                try:
                    t.check(endpoint, body)
                except t.RequestError as exc:  # mistyped: the same 400 line as offline, never sent
                    line = exc.line(custom_id)
                else:
                    line = await self._send(client, urls, first, custom_id, server_body(endpoint, body), budget)
                if on_progress is not None:
                    on_progress(1)
                return line

            plan = _sending_plan(endpoint, requests, len(urls))
            tasks = {i: asyncio.create_task(one(*requests[i], server)) for i, server in plan}
            try:
                done = await asyncio.gather(*tasks.values())
                by_row = dict(zip(tasks, done, strict=True))
                return [by_row[i] for i in range(len(requests))]
            except BaseException:
                for task in tasks.values():
                    task.cancel()
                raise

    async def _send(self, client: httpx.AsyncClient, urls: Sequence[str], first: int, custom_id: str,
                    body: dict[str, Any], budget: Budget) -> Line:
        """One request, sent within the budget (a place held only while it is out) and resent until a server
        answers it for good.

        A server that went away (connection refused or reset, or a router's 502/503/504 when it has no healthy
        replica) costs the request nothing until `failover_s` has passed with no server answering any request: then
        the shard fails (EngineCrash) and the step retries it. A busy server (429, or vLLM's own 503 when its queue
        is full) costs nothing either: the budget backs off and the request waits its turn again, however long the
        servers are busy (a 429 is an answer: it never counts as away). A request whose place the budget takes back
        for interactive traffic is sent again when there is room. A 4xx is the request's own error; other 5xx
        answers become its error line after a few attempts.
        """
        loop = asyncio.get_running_loop()
        since = loop.time()
        server_errors = 0
        for attempt in itertools.count():
            url = urls[(first + attempt) % len(urls)]
            gone, response = "", None
            async with budget.place() as held:
                try:
                    response = await held.run(client.post(url, json=body))
                except httpx.TransportError as exc:
                    gone = f"{url} unreachable: {exc!r}"
            if response is None and not gone:
                continue  # taken back: its place went to interactive traffic
            budget.answered(None if response is None else response.status_code)
            if response is not None:
                try:
                    payload, from_vllm = response.json(), True
                except ValueError:
                    payload, from_vllm = {"message": response.text[:500]}, False
                status = response.status_code
                if status == 200:
                    return c.success_line(custom_id, payload)
                if status in _BUSY and (status == 429 or from_vllm):
                    gone = "" if status == 429 else f"{url} answered {status} (busy)"
                elif status < 500:
                    return _error_line(custom_id, status, payload)
                # vLLM answers errors in JSON; a plain-text 5xx is the router's "error sending request" to a
                # replica that just died, before its health checks take it out of rotation.
                elif status in _SERVER_AWAY or not from_vllm:
                    gone = f"{url} answered {status}"
                else:
                    server_errors += 1
                    if server_errors >= _ATTEMPTS:
                        return _error_line(custom_id, status, payload)
            # Away means no server answered any request since: one that answers others is there, only busy.
            if gone and loop.time() - max(since, budget.answered_at) >= self.failover_s:
                raise EngineCrash(f"No server answered for {self.failover_s:.0f}s; last: {gone}")
            await asyncio.sleep(min(0.5 * 2 ** min(attempt, 5), 10.0))
        raise AssertionError("unreachable")


def _prefix_order(endpoint: str, body: dict[str, Any]) -> tuple[str, int]:
    """Where a request goes in the sending order: by its prompt's prefix path, then its length."""
    try:
        f = features(endpoint, body)
    except (AttributeError, KeyError, TypeError):  # a mistyped body: its 400 line comes from t.check
        return "", 0
    return f.prefix_key, f.prompt_chars


def _sending_plan(endpoint: str, requests: Sequence[Request], servers: int) -> list[tuple[int, int]]:
    """(row, first server) in sending order: each server takes a contiguous run of the shard in prefix order.

    As the offline engine submits a shard, requests sharing a prefix reach their server together, so its
    prefix cache computes the prefix once; the runs are sent interleaved so that every server is busy.
    """
    order = sorted(range(len(requests)), key=lambda i: _prefix_order(endpoint, requests[i][1]))
    runs = [order[k * len(order) // servers : (k + 1) * len(order) // servers] for k in range(servers)]
    return [(run[n], k) for n in range(max(map(len, runs), default=0)) for k, run in enumerate(runs) if n < len(run)]


def server_command(spec: Any, model_path: str, host: str, port: int) -> list[str]:
    """The command that starts a vLLM OpenAI-compatible server for a registry model, same settings as offline."""
    import sys

    from .offline import OfflineEngine

    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
            "--served-model-name", spec.name]
    for key, value in OfflineEngine(spec, model_path).llm_kwargs().items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            import json

            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args
