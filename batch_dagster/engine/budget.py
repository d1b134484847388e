"""The batch dispatcher's budget: how many of its requests may be in flight on servers that may also answer
interactive traffic, recomputed from the servers' own metrics (vLLM's /metrics) with additive increase and
multiplicative decrease, so that batch work takes what interactive traffic leaves.

Each reading sums the servers' `vllm:num_requests_running` and `vllm:num_requests_waiting` (the requests they hold,
the dispatcher's and everyone else's) and their time-to-first-token and inter-token latency histograms. Requests
beyond the dispatcher's own in flight are someone else's: while there are some (and for `quiet_s` after), the fleet is
shared. Then the budget drops to its floor at once, the dispatcher's newest requests beyond it are taken back (the
server aborts them; they are sent again later, none lost), and it grows by one per reading while the servers'
latencies stay within `slack` of the lowest seen while shared, halving when they do not or when a server answers
429, 503 or an error. While the fleet is the dispatcher's alone, the budget doubles per reading up to its ceiling.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from .health import in_background, unless

log = logging.getLogger(__name__)
T = TypeVar("T")

INTERVAL_S = 0.5  # between readings of the servers' metrics
QUIET_S = 5.0  # the fleet counts as shared this long after other requests were last seen on it
SLACK = 0.2  # how far the servers' latencies may rise over the lowest seen while shared before the budget halves
LATENCY_MEMORY_S = 120.0  # the lowest latencies are those of the readings this recent
MIN_TOKENS = 8  # a reading's latency counts when the servers produced at least this many tokens since the last
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.MULTILINE)
_SUMMED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_sum",
           "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_sum",
           "vllm:inter_token_latency_seconds_count")


@dataclass(frozen=True)
class Reading:
    """The servers' metrics at one moment, summed over servers (the histograms as their running sums and counts)."""

    running: float = 0.0
    waiting: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0

    def __add__(self, other: Reading) -> Reading:
        return Reading(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[float, ...]:
        return (self.running, self.waiting, self.ttft_sum, self.ttft_count, self.itl_sum, self.itl_count)

    @classmethod
    def parse(cls, text: str) -> Reading:
        """From a vLLM server's /metrics (Prometheus text), every engine and model of it summed; ValueError when it
        has none of vLLM's request gauges (not a vLLM server)."""
        sums = dict.fromkeys(_SUMMED, 0.0)
        for name, value in _SAMPLE.findall(text):
            if name in sums and value != "NaN":
                sums[name] += float(value)
        if "vllm:num_requests_running" not in text:
            raise ValueError("no vllm:num_requests_running: not a vLLM server's metrics")
        return cls(*sums.values())


def interval_mean(now: Reading, before: Reading, total: str, count: str) -> float | None:
    """A histogram's mean over the observations between two readings (None: too few, or a server restarted)."""
    observed = getattr(now, count) - getattr(before, count)
    spent = getattr(now, total) - getattr(before, total)
    return spent / observed if observed >= MIN_TOKENS and spent >= 0 else None


@dataclass
class Held:
    """One request's place in the budget; `taken_back` is set when the budget needs the place for someone else."""

    taken_back: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when the place was taken back first (the work is cancelled)."""
        return await unless(self.taken_back, work)


class Budget:
    """How many requests the dispatcher may have in flight: `ceiling` (BATCH_VLLM_MAX_CONCURRENCY) when not
    `adaptive`; else recomputed from each reading of the servers (`observe`) and each answer (`answered`)."""

    def __init__(self, ceiling: int, *, adaptive: bool = False, floor: int = 1, slack: float = SLACK,
                 quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic):
        self.ceiling, self.floor, self.adaptive = max(ceiling, 1), max(min(floor, ceiling), 1), adaptive
        self.slack, self.quiet_s, self.clock = slack, quiet_s, clock
        self.limit = self.floor if adaptive else self.ceiling
        self.held: list[Held] = []  # in the order they were taken: the newest last
        self.shared_until = -math.inf
        self.last_decrease = -math.inf
        self.answered_at = -math.inf  # when a server last answered a request (not 429, not 5xx)
        self.previous: Reading | None = None
        self.lowest: deque[tuple[float, float, float]] = deque()  # (at, ttft, itl) of readings while shared
        self.changed = asyncio.Condition()
        # (at, limit, in flight, shared) of the recent readings: what it did (a bench's report)
        self.history: deque[tuple[float, int, int, bool]] = deque(maxlen=100_000)

    @property
    def in_flight(self) -> int:
        return len(self.held)

    @property
    def shared(self) -> bool:
        return self.clock() < self.shared_until

    @asynccontextmanager
    async def place(self):
        """Wait for a place within the limit, and hold it until the block ends."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.in_flight < self.limit)
            held = Held()
            self.held.append(held)
        try:
            yield held
        finally:
            self.held.remove(held)
            async with self.changed:
                self.changed.notify_all()

    def answered(self, status: int | None) -> None:
        """A server's answer to one request (None: no answer): 429, 5xx and no answer at all halve the budget; any
        other answer says the servers are there (`answered_at`)."""
        if status is not None and status != 429 and status < 500:
            self.answered_at = self.clock()
        elif self.adaptive:
            self._decrease(self.clock(), "server pressure" if status else "no answer")

    def observe(self, reading: Reading | None, in_flight: int) -> None:
        """One reading of the servers (None: they could not be read), taken while `in_flight` of the dispatcher's
        requests were out: the budget for the next interval."""
        if not self.adaptive:
            return
        now = self.clock()
        previous, self.previous = self.previous, reading
        others = reading.running + reading.waiting - in_flight if reading is not None else 0.0
        # Another client's requests (never the dispatcher's own, which the servers count late or not yet).
        if others >= 1 and not self.shared:
            self.shared_until = now + self.quiet_s
            log.info("batch budget %d -> %d (other clients' requests on the servers)", self.limit, self.floor)
            self.limit = self.floor  # yield at once, not by halvings
            self.last_decrease = now
            self._take_back()
        elif others >= 1:
            self.shared_until = now + self.quiet_s
        if now == self.last_decrease:
            pass  # it just yielded
        elif self.shared and reading is not None and previous is not None and self._too_slow(now, reading, previous):
            self._decrease(now, "latency")
        elif not self.shared:
            self.limit = min(self.ceiling, self.limit * 2)
        elif self.in_flight >= self.limit and now - self.last_decrease >= INTERVAL_S:
            self.limit = min(self.ceiling, self.limit + 1)  # the limit binds, and the servers keep up
        self.history.append((now, self.limit, self.in_flight, self.shared))
        self._notify()

    def _too_slow(self, now: float, reading: Reading, previous: Reading) -> bool:
        """Whether the servers' latencies since the last reading are past the lowest recent ones by more than the
        slack, or requests wait; a reading's latencies join those the lowest is taken from."""
        if reading.waiting >= 1:
            return True
        ttft = interval_mean(reading, previous, "ttft_sum", "ttft_count")
        itl = interval_mean(reading, previous, "itl_sum", "itl_count")
        while self.lowest and self.lowest[0][0] < now - LATENCY_MEMORY_S:
            self.lowest.popleft()
        low_ttft = min((t for _, t, _ in self.lowest if t > 0), default=None)
        low_itl = min((i for _, _, i in self.lowest if i > 0), default=None)
        self.lowest.append((now, ttft or 0.0, itl or 0.0))
        return any(value is not None and low is not None and value > low * (1 + self.slack)
                   for value, low in ((ttft, low_ttft), (itl, low_itl)))

    def _decrease(self, now: float, why: str) -> None:
        if now - self.last_decrease < INTERVAL_S:  # one halving per interval, however many answers said so
            return
        self.last_decrease = now
        limit = max(self.floor, self.limit // 2)
        if limit != self.limit:
            log.info("batch budget %d -> %d (%s)", self.limit, limit, why)
        self.limit = limit
        if self.shared:
            self._take_back()
        self._notify()

    def _take_back(self) -> None:
        """Take back the newest places beyond the limit."""
        for held in self.held[self.limit:]:
            held.taken_back.set()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(wake())
        except RuntimeError:  # no loop (a test driving the arithmetic alone): nobody waits
            pass


class ServerMetrics:
    """Reads the servers' /metrics: each base URL that is a vllm-router stands for its workers (its /list_workers,
    asked again every `refresh_s`), any other is read itself."""

    def __init__(self, client: httpx.AsyncClient, base_urls: Sequence[str], refresh_s: float = 30.0):
        self.client, self.base_urls, self.refresh_s = client, [u.rstrip("/") for u in base_urls], refresh_s
        self.servers: list[str] = []
        self.listed_at = -math.inf

    async def read(self) -> Reading | None:
        """The servers' reading, or None when one of them could not be read (the budget then goes by answers)."""
        if time.monotonic() - self.listed_at > self.refresh_s:
            self.servers = [s for url in self.base_urls for s in await self._workers(url)]
            self.listed_at = time.monotonic()
        try:
            readings = await asyncio.gather(*(self._read(url) for url in self.servers))
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("the servers' metrics could not be read: %r", exc)
            self.listed_at = -math.inf  # a replica may have moved: list them again
            return None
        return sum(readings, Reading())

    async def _workers(self, url: str) -> list[str]:
        try:
            response = await self.client.get(url + "/list_workers", timeout=5)
            urls = response.json().get("urls") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            urls = None
        return [str(u).rstrip("/") for u in urls] if isinstance(urls, list) and urls else [url]

    async def _read(self, url: str) -> Reading:
        response = await self.client.get(url + "/metrics", timeout=5)
        response.raise_for_status()
        return Reading.parse(response.text)


async def keep_recomputing(budget: Budget, metrics: ServerMetrics, interval_s: float = INTERVAL_S) -> None:
    """Read the servers and recompute the budget every `interval_s`, until cancelled."""
    while True:
        before = budget.in_flight
        reading = await metrics.read()
        # Its own requests are those out at either end of the reading: one sent meanwhile may be counted already.
        budget.observe(reading, max(before, budget.in_flight))
        await asyncio.sleep(interval_s)


@asynccontextmanager
async def recomputed(budget: Budget, client: httpx.AsyncClient, base_urls: Sequence[str]):
    """The budget, recomputed from the servers' metrics while the block runs (when it is adaptive)."""
    if not budget.adaptive:
        yield budget
        return
    async with in_background(keep_recomputing(budget, ServerMetrics(client, base_urls))):
        yield budget
