"""The server engine: requests sent concurrently, with a bound, to OpenAI-compatible vLLM servers."""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from batch_dagster.batchfile.failure import public
from batch_dagster.batchfile.fields import Serves
from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.settings import default

from . import lines as ln
from .base import EngineCrash, Line, OnProgress, Request, dispatch
from .budget import Budget, recomputed
from .flags import engine_flags
from .health import HUNG_AFTER_S, Health, ServerHung, watched

log = logging.getLogger(__name__)

_ATTEMPTS = 3  # answers of 500 before a request's error line
# What a router (or a proxy) answers when no healthy server can take the request: the request is resent.
_SERVER_AWAY = {502, 503, 504}
# A server asking for less (rate limited; vLLM's 503 when its queue is full): the request waits and is sent again.
_BUSY = {429, 503}


@dataclass
class ServerEngine:
    """Runs shards against one or more vLLM servers (`base_urls` end before `/v1`)."""

    base_urls: Sequence[str]
    max_concurrency: int = default("BATCH_VLLM_MAX_CONCURRENCY")
    timeout_s: float = 600.0
    api_key: str | None = None
    failover_s: float = 120.0  # how long requests are resent while no server answers
    serves: Serves | None = None  # what the model takes: a body asking for more is its 400 line, never sent
    budget: str = default("BATCH_VLLM_BUDGET")  # "fixed": max_concurrency in flight; "adaptive": engine/budget.py
    hung_after_s: float = HUNG_AFTER_S  # a server that answers nothing this long is given up (engine/health.py)

    def run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None = None) -> list[Line]:
        return asyncio.run(self._run(endpoint, requests, on_progress))

    async def _run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None) -> list[Line]:
        if not self.base_urls:
            raise EngineCrash("Server mode needs at least one server URL.")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.max_concurrency + 4)  # and the budget's readings of the servers
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers, limits=limits) as client, \
                recomputed(Budget(self.max_concurrency, adaptive=self.budget == "adaptive"), client,
                           self.base_urls) as budget:
            servers = await self._servers(client)
            async with watched(servers, self.hung_after_s) as health:

                async def send(custom_id: str, body: dict[str, Any], first: int) -> Line:
                    return await self._send(client, health, endpoint, first, custom_id, body, budget)

                # The budget holds the requests in flight (at most max_concurrency): no second limit here.
                return await dispatch(endpoint, requests, send, serves=self.serves, lanes=len(servers),
                                      on_progress=on_progress)

    async def _servers(self, client: httpx.AsyncClient) -> list[str]:
        """The vLLM servers behind the base URLs: for a vllm-router, the healthy replicas it lists (GET /workers).

        Bodies go to vLLM as they are. vllm-router (0.1.17) parses a request into its own types and sends what it
        kept, which drops fields it does not know (a chat tool's `strict`, embeddings' `embed_dtype`) and breaks
        /v1/rerank; the router still checks the replicas' health and restarts nothing of ours, and a URL that lists
        no workers (a vLLM server, or a router that is away) is used as it is.
        """
        found: list[str] = []
        for base in self.base_urls:
            base = base.rstrip("/")
            try:
                healthy = healthy_workers(await client.get(base + "/workers", timeout=5))
            except httpx.HTTPError:
                healthy = []
            found += healthy or [base]
        return list(dict.fromkeys(found))

    async def _send(self, client: httpx.AsyncClient, health: Health, endpoint: str, first: int, custom_id: str,
                    body: dict[str, Any], budget: Budget) -> Line:
        """One request, sent within the budget (a place held only while it is out) and resent until a server
        answers it for good.

        A server that went away (connection refused or reset, a router's 502/503/504 when it has no healthy
        replica, or hung: engine/health.py gives up its requests) costs the request nothing until `failover_s` has
        passed with no server answering any request: then the shard fails (EngineCrash) and the step retries it. A
        busy server (429, or vLLM's own 503 when its queue is full) costs nothing either: the budget backs off and
        the request waits its turn again, however long the servers are busy (a 429 is an answer: it never counts as
        away). A request whose place the budget takes back for interactive traffic is sent again when there is room.
        A 4xx is the request's own error; other 5xx answers become its error line after a few attempts.
        """
        loop = asyncio.get_running_loop()
        since = loop.time()
        server_errors = 0
        for attempt in itertools.count():
            server = health.choose(first + attempt)
            url = server + endpoint
            gone, response = "", None
            async with budget.place() as held:
                try:
                    response = await held.run(health.guard(server, client.post(url, json=body)))
                except (httpx.TransportError, ServerHung) as exc:
                    gone = f"{url} unreachable: {exc!r}"
            if response is None and not gone:
                continue  # taken back: its place went to interactive traffic
            budget.answered(None if response is None else response.status_code)
            if response is not None:
                try:
                    payload, from_vllm = response.json(), True
                except ValueError:
                    payload, from_vllm = {"message": public(response.text[:500])}, False
                status = response.status_code
                if status in _BUSY and (status == 429 or from_vllm):
                    gone = "" if status == 429 else f"{url} answered {status} (busy)"
                elif status < 500:
                    return ln.answer_line(custom_id, status, payload)
                # vLLM answers errors in JSON; a plain-text 5xx is the router's "error sending request" to a
                # replica that just died, before its health checks take it out of rotation.
                elif status in _SERVER_AWAY or not from_vllm:
                    gone = f"{url} answered {status}"
                else:
                    server_errors += 1
                    if server_errors >= _ATTEMPTS:
                        return ln.answer_line(custom_id, status, payload)
            # Away means no server answered any request since: one that answers others is there, only busy.
            if gone and loop.time() - max(since, budget.answered_at) >= self.failover_s:
                raise EngineCrash(f"No server answered for {self.failover_s:.0f}s; last: {gone}")
            await asyncio.sleep(min(0.5 * 2 ** min(attempt, 5), 10.0))
        raise AssertionError("unreachable")


def healthy_workers(answer: httpx.Response) -> list[str]:
    """The healthy replicas a vllm-router lists (its answer to GET /workers); none from anything else."""
    try:
        workers = answer.json().get("workers", []) if answer.status_code == 200 else []
        return [w["url"].rstrip("/") for w in workers if w.get("is_healthy", True)]
    except (ValueError, AttributeError, TypeError, KeyError):
        return []


def server_command(spec: ModelSpec, model_path: str, host: str, port: int) -> list[str]:
    """The command that starts a vLLM OpenAI-compatible server for a registry model: the in-process engine's flags."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
            *engine_flags(spec, model_path)]
