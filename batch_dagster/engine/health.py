"""Which servers answer at all. A server that is stopped (SIGSTOP), wedged or cut off holds its connections open
and answers nothing, so each request out to it would wait the whole request timeout (600 s). Each server is asked
GET /health every `interval_s`, by a client of its own; any HTTP answer counts (a 503 or a 404 is an answer: busy or
old, not hung). A server that has answered nothing for `hung_after_s` is hung: the requests out to it are given up
(ServerHung: the dispatcher sends them to the others) and none go to it until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx

log = logging.getLogger(__name__)
T = TypeVar("T")

INTERVAL_S = 2.0  # between probes of a server
PROBE_TIMEOUT_S = 5.0
HUNG_AFTER_S = 20.0  # without any answer: a server under load still answers /health within a second or two


class ServerHung(Exception):
    """The server a request was out to stopped answering anything."""


async def unless(event: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when `event` is set first (the work is cancelled: an HTTP request's connection is
    closed, and the server aborts it)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # the work's own end no longer matters
        await task
    return None


class Health:
    """The servers' health as their probes found it (`probed`, by keep_probing); `choose` and `guard` use it."""

    def __init__(self, servers: Sequence[str], *, hung_after_s: float = HUNG_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.servers, self.hung_after_s, self.clock = list(servers), hung_after_s, clock
        self.answered_at = dict.fromkeys(servers, clock())
        self.hung_now = {server: asyncio.Event() for server in servers}

    def hung(self, server: str) -> bool:
        return self.hung_now[server].is_set()

    def choose(self, i: int) -> str:
        """The i-th server (round the list), or the next that is not hung (the i-th when all are)."""
        n = len(self.servers)
        for k in range(n):
            if not self.hung(server := self.servers[(i + k) % n]):
                return server
        return self.servers[i % n]

    async def guard(self, server: str, work: Awaitable[T]) -> T:
        """`work` (a request out to `server`), given up with ServerHung when the server is, or becomes, hung."""
        result = await unless(self.hung_now[server], work)
        if result is None:
            raise ServerHung(f"{server} answered nothing for {self.hung_after_s:.0f}s")
        return result

    def probed(self, server: str, answered: bool) -> None:
        """One probe of `server`: whether it answered at all."""
        now = self.clock()
        if answered:
            self.answered_at[server] = now
        hung = now - self.answered_at[server] >= self.hung_after_s
        if hung and not self.hung(server):
            log.warning("%s has answered nothing for %.0f s: its requests go to the other servers", server,
                        now - self.answered_at[server])
            self.hung_now[server].set()
        elif not hung and self.hung(server):
            log.warning("%s answers again: requests go to it again", server)
            self.hung_now[server].clear()


async def keep_probing(health: Health, client: httpx.AsyncClient, interval_s: float = INTERVAL_S) -> None:
    """Probe every server every `interval_s`, until cancelled."""

    async def probe(server: str) -> None:
        try:
            await client.get(server + "/health")
            health.probed(server, True)
        except httpx.HTTPError:
            health.probed(server, False)

    while True:
        await asyncio.gather(*(probe(server) for server in health.servers))
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def watched(servers: Sequence[str], hung_after_s: float = HUNG_AFTER_S):
    """The servers' Health, probed while the block runs."""
    health = Health(servers, hung_after_s=hung_after_s)
    async with httpx.AsyncClient(timeout=min(PROBE_TIMEOUT_S, hung_after_s)) as client, \
            in_background(keep_probing(health, client)):
        yield health


@asynccontextmanager
async def in_background(work: Awaitable[Any]):
    """`work` running as a task while the block runs; cancelled when it ends."""
    task = asyncio.ensure_future(work)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
