"""A batch on a fleet that also answers interactive requests (issue #32): the interactive client's latency and the
batch's throughput, with the dispatcher's budget `fixed` (BATCH_VLLM_MAX_CONCURRENCY in flight) and `adaptive`
(engine/budget.py), each ratio taken in one run on one warm fleet (`batch-dagster fleet`). BENCH_SHARED_SWEEP
("1,2,4": concurrencies) adds the fixed budget at each of them: the frontier any budget trades along on this fleet.

Phases, one after the other: the interactive client alone; the batch alone (its throughput on an idle fleet); then
the client and the batch together, once per budget. The client sends BENCH_SHARED_RATE chat requests a second
(open loop: on schedule, whatever is in flight), each timed end to end; the batch is BENCH_SHARED_REQUESTS chat
requests through ServerEngine, as the pipeline sends a shard. Writes bench/results/shared_fleet.json
(BENCH_SHARED_OUT) and prints a table. Run under `flock /work/.locks/bench flock /work/.locks/fleet`.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from batch_dagster.batchfile import contract as c
from batch_dagster.engine.server import ServerEngine
from bench.fleet_scaling import _start_fleet, _stop
from bench.run_bench import REPO

CHAT_MODEL = os.environ.get("BENCH_MODEL") or "smollm2-135m-instruct"


def chat(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write one short sentence about the number {i}."}]}


class Interactive(threading.Thread):
    """Sends `rate` requests a second to `url` until stopped; each one's latency (s) or its failure."""

    def __init__(self, url: str, rate: float, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.rate, self.max_tokens = url + "/v1/chat/completions", rate, max_tokens
        self.latencies: list[float] = []
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> None:
                t0 = time.perf_counter()
                try:
                    response = await client.post(self.url, json=chat(10_000 + i, self.max_tokens))
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.latencies.append(time.perf_counter() - t0)
                else:
                    self.failed += 1

            tasks, start, i = [], time.perf_counter(), 0
            while not self.stop.is_set():
                tasks.append(asyncio.ensure_future(one(i)))
                i += 1
                await asyncio.sleep(max(0.0, start + i / self.rate - time.perf_counter()))
            await asyncio.gather(*tasks)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        if not lat:
            return {"requests": 0, "failed": self.failed}
        return {"requests": len(lat), "failed": self.failed, "p50_s": round(statistics.median(lat), 3),
                "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)}


def batch(url: str, n: int, max_tokens: int, budget: str, concurrency: int) -> dict[str, Any]:
    engine = ServerEngine([url], max_concurrency=concurrency, budget=budget)
    t0 = time.perf_counter()
    lines = engine.run(c.CHAT, [(f"b{i}", chat(i, max_tokens)) for i in range(n)])
    wall = time.perf_counter() - t0
    ok = sum(1 for line in lines if (line.get("response") or {}).get("status_code") == 200)
    return {"budget": budget, "requests": n, "completed": ok, "wall_s": round(wall, 2),
            "requests_per_s": round(ok / wall, 2)}


def with_client(url: str, rate: float, max_tokens: int, work) -> tuple[dict[str, Any], Any]:
    client = Interactive(url, rate, max_tokens)
    client.start()
    try:
        result = work()
    finally:
        client.stop.set()
        client.join(180)
    return client.summary(), result


def main() -> None:
    n = int(os.environ.get("BENCH_SHARED_REQUESTS") or 500)
    rate = float(os.environ.get("BENCH_SHARED_RATE") or 1.0)
    alone_s = float(os.environ.get("BENCH_SHARED_ALONE_S") or 30)
    batch_tokens = int(os.environ.get("BENCH_SHARED_BULK_TOKENS") or 16)
    chat_tokens = int(os.environ.get("BENCH_SHARED_CHAT_TOKENS") or 16)
    concurrency = int(os.environ.get("BENCH_SHARED_CONCURRENCY") or 32)
    # The frontier: the fixed budget at each of these concurrencies too (what any budget can trade on this fleet).
    sweep = [int(x) for x in (os.environ.get("BENCH_SHARED_SWEEP") or "").split(",") if x.strip()]
    runs = [("fixed", "fixed", concurrency), ("adaptive", "adaptive", concurrency),
            *((f"fixed_{k}", "fixed", k) for k in sweep)]  # (report key, budget, concurrency), beside the client
    out = Path(os.environ.get("BENCH_SHARED_OUT") or REPO / "bench" / "results" / "shared_fleet.json")
    report: dict[str, Any] = {"requests": n, "rate_per_s": rate, "concurrency": concurrency,
                              "batch_max_tokens": batch_tokens, "chat_max_tokens": chat_tokens, "sweep": sweep}
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as work:
        proc, url, _, start_s = _start_fleet(CHAT_MODEL, 1, "round_robin", Path(work))
        try:
            report["fleet_start_s"] = round(start_s, 1)
            batch(url, 16, batch_tokens, "fixed", concurrency)  # warm-up
            report["interactive_alone"], _ = with_client(url, rate, chat_tokens, lambda: time.sleep(alone_s))
            print(f"interactive alone: {report['interactive_alone']}", file=sys.stderr, flush=True)
            report["batch_alone"] = batch(url, n, batch_tokens, "fixed", concurrency)
            print(f"batch alone: {report['batch_alone']}", file=sys.stderr, flush=True)
            for name, budget, limit in runs:
                client, result = with_client(url, rate, chat_tokens,
                                             lambda b=budget, k=limit: batch(url, n, batch_tokens, b, k))
                report[f"shared_{name}"] = {"interactive": client, "batch": {**result, "concurrency": limit}}
                print(f"shared, {name}: {report[f'shared_{name}']}", file=sys.stderr, flush=True)
        finally:
            _stop(proc)
    alone = report["interactive_alone"]
    for name, _, _ in runs:
        shared = report[f"shared_{name}"]
        shared["p99_vs_alone"] = round(shared["interactive"]["p99_s"] / alone["p99_s"], 2)
        shared["p50_vs_alone"] = round(shared["interactive"]["p50_s"] / alone["p50_s"], 2)
        shared["batch_vs_alone"] = round(shared["batch"]["requests_per_s"] / report["batch_alone"]["requests_per_s"],
                                         2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("| budget | interactive p50 | p99 | p99 vs alone (goal <= 1.2) | batch req/s | vs idle fleet (goal >= 0.5) |")
    print("|---|---|---|---|---|---|")
    print(f"| none (interactive alone) | {alone['p50_s']} | {alone['p99_s']} | 1.0 | | |")
    for name, budget, limit in runs:
        s, shown = report[f"shared_{name}"], budget if name == budget else f"fixed at {limit}"
        print(f"| {shown} | {s['interactive']['p50_s']} | {s['interactive']['p99_s']} | {s['p99_vs_alone']} | "
              f"{s['batch']['requests_per_s']} | {s['batch_vs_alone']} |")


if __name__ == "__main__":
    main()
