"""Slow work of a request kept out of the API's shared worker pool: a lane has threads of its own, runs at most
`per_key` works of one key at once and lets at most `queued_per_key` of them wait or run (past it, a 429), and at
most `queued` of all keys' together (past it, a 503), so one key's flood of estimates or webhook endpoint lookups
never holds the threads every other request needs, and many keys' floods never hold the API's memory."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

from .errors import ApiError

T = TypeVar("T")
V = TypeVar("V")


class Lane:
    """Threads of its own for one kind of slow work, with bounds per key (a waiting request holds no thread)."""

    def __init__(self, name: str, *, workers: int, per_key: int, queued_per_key: int, queued: int, what: str):
        self.name, self.per_key, self.queued_per_key, self.queued, self.what = (name, per_key, queued_per_key, queued,
                                                                                what)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._in_flight: dict[str, int] = {}
        self._total = 0

    @asynccontextmanager
    async def admitted(self, owner: str) -> AsyncIterator[None]:
        """The owner's request counted in flight while inside; ApiError 429 when it has `queued_per_key` already,
        503 when all keys have `queued`. (The event loop's thread alone touches the counts.)"""
        if self._in_flight.get(owner, 0) >= self.queued_per_key:
            raise ApiError(429, f"This key already has {self.queued_per_key} {self.what} in flight; send more when "
                           "they have answered.", type="rate_limit_exceeded", code=f"too_many_{self.name}")
        if self._total >= self.queued:
            raise ApiError(503, f"The service already has {self.queued} {self.what} in flight, its bound across all "
                           "keys; send this one when they have answered.", type="server_error",
                           code=f"{self.name}_busy")
        self._in_flight[owner] = self._in_flight.get(owner, 0) + 1
        self._total += 1
        try:
            yield
        finally:
            self._total -= 1
            self._in_flight[owner] -= 1
            if not self._in_flight[owner]:
                del self._in_flight[owner]
                self._turns.pop(owner, None)

    async def run(self, owner: str, work: Callable[[], T]) -> T:
        """`work()` on the lane's threads, in the owner's turn (at most `per_key` of its works at once)."""
        async with self._turns.setdefault(owner, asyncio.Semaphore(self.per_key)):
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Kept(Generic[V]):
    """The last `size` values computed, by key (thread-safe)."""

    def __init__(self, size: int):
        self.size = size
        self._values: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            if key not in self._values:
                return None
            self._values.move_to_end(key)
            return self._values[key]

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)
