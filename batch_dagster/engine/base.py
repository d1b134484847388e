"""What every engine does: a shard's requests sent to vLLM's OpenAI layer in the order given, each answered by its line.

Both engines send the same bodies to the same vLLM application (`vllm serve`'s own, in this process or in a
server) and make the same line of its answer; they differ only in how a request reaches it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from batch_dagster.batchfile.fields import Serves
from batch_dagster.batchfile.shard import request_features

from . import lines as ln

Request = tuple[str, dict[str, Any]]  # (custom_id, body)
Line = ln.Line
OnProgress = Callable[[int], None]  # called with the number of requests just finished
# Sends one body (as vLLM takes it) to the lane it is planned on; answers its line.
Send = Callable[[str, dict[str, Any], int], Awaitable[Line]]


class EngineCrash(RuntimeError):
    """The engine itself failed (died, unreachable); the whole shard may be retried."""


class Engine(Protocol):
    def run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None = None) -> list[Line]:
        """One output or error line per request, in any order."""
        ...


def sending_plan(endpoint: str, requests: Sequence[Request], lanes: int) -> list[tuple[int, int]]:
    """(row, lane) in sending order: each lane (a server) takes a contiguous run of the shard in the order given
    (the inference step's: batchfile/shard.py's `running_order`, shared prefixes together, the longest work first),
    the runs cut where each holds about as much expected work (`Features.work`) as the others.

    Sent in prefix order, requests sharing a prefix are neighbours in vLLM's first-come queue: the first one's
    prefix blocks are cached when it is scheduled, and the rest hit them before the cache evicts them. Cut by work,
    not by count, the lane of the longest requests takes fewer of them and the servers end together. The lanes'
    runs are sent interleaved, so every lane is busy.
    """
    work = [request_features(endpoint, body).work() + 1 for _, body in requests]
    # Each row at the middle of its own work along the shard's: lane k takes the rows whose middles are in the k-th
    # of `lanes` equal parts of the whole.
    middles = [end - w / 2 for end, w in zip(itertools.accumulate(work), work, strict=True)]
    cuts = [0, *(bisect.bisect_right(middles, sum(work) * k / lanes) for k in range(1, lanes)), len(requests)]
    runs = [range(cuts[k], cuts[k + 1]) for k in range(lanes)]
    return [(run[n], k) for n in range(max(map(len, runs), default=0)) for k, run in enumerate(runs) if n < len(run)]


async def dispatch(endpoint: str, requests: Sequence[Request], send: Send, *, serves: Serves | None = None,
                   lanes: int = 1, limit: int | None = None, on_progress: OnProgress | None = None,
                   counted: Callable[[Line], bool] = lambda line: True) -> list[Line]:
    """Every request sent (at most `limit` at a time), each answered by its line, in the order of `requests`.

    A body the checks refuse (for a model that `serves`) is its 400 line and never sent. `on_progress` hears of each
    finished request whose line is `counted` (a line to be retried is not), with the shard's load just before
    (`report_load`).
    """
    gate = asyncio.Semaphore(limit) if limit else None
    report_load = getattr(on_progress, "report_load", None)
    unfinished = len(requests)

    async def one(custom_id: str, body: dict[str, Any], lane: int) -> Line:
        nonlocal unfinished
        try:
            ln.check(endpoint, body, serves)
        except ln.RequestError as exc:  # mistyped or refused: the same 400 line on every engine, never sent
            line = exc.line(custom_id)
        else:
            if gate is None:
                line = await send(custom_id, ln.vllm_body(endpoint, body), lane)
            else:
                async with gate:
                    line = await send(custom_id, ln.vllm_body(endpoint, body), lane)
        unfinished -= 1
        if on_progress is not None and counted(line):
            if report_load is not None:
                report_load(f"{unfinished} unfinished")
            on_progress(1)
        return line

    plan = sending_plan(endpoint, requests, lanes)
    tasks = {i: asyncio.ensure_future(one(*requests[i], lane)) for i, lane in plan}
    try:
        done = await asyncio.gather(*tasks.values())
    except BaseException:
        for task in tasks.values():
            task.cancel()
        raise
    by_row = dict(zip(tasks, done, strict=True))
    return [by_row[i] for i in range(len(requests))]
