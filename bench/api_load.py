"""A bounded load test of the HTTP API on loopback: N concurrent clients create (upload + batches.create), list
and retrieve for a fixed time against `python -m batch_dagster.serve`, on SQLite and on PostgreSQL.

    python -m bench.api_load [--db sqlite|postgres|both] [--clients 32] [--duration 60]   (make bench-api)
    python -m bench.api_load --url http://127.0.0.1:8000 --key sk-...                     (a running server)

It stops by itself: after --duration seconds or --max-requests requests, whichever comes first. It reports
p50/p99 latency per operation, and counts every 5xx, every transport error and every answer that mentions
"database is locked" (also looked for in serve's log). The batches' requests name a model that is not in the
registry, so each batch's run ends at validation without an engine: the load is on the API and the store,
while the daemon's sensors and those runs write to the same store. Serve's runs are queued one at a time
(concurrency.runs.max_concurrent_runs: 1) so that a few hundred batches do not start a few hundred run processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from batch_dagster.defs.instance import INSTANCE_CONFIG
from bench.measure import stop_service
from bench.postgres import TempPostgres, _free_port

REPO = Path(__file__).resolve().parent.parent
LOAD_KEY = "sk-load-test"
LOCKED = "database is locked"
OWN_PREFIXES = ("BATCH_", "DAGSTER_")
# How often each client picks each operation after its first create.
MIX = {"create": 1, "list_batches": 3, "retrieve_batch": 3, "list_files": 1, "retrieve_file": 2}


def _input_file(client: int, n: int) -> bytes:
    lines = [json.dumps({"custom_id": f"c{client}-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "load-test-model", "messages": [{"role": "user", "content": f"hi {i}"}]}})
             for i in range(n)]
    return ("\n".join(lines) + "\n").encode()


@dataclass
class Results:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    errors: list[str] = field(default_factory=list)  # transport errors, 5xx and lock messages
    requests: int = 0

    def record(self, op: str, response: httpx.Response, seconds: float) -> None:
        self.requests += 1
        self.latencies[op].append(seconds)
        self.statuses[op][response.status_code] += 1
        if response.status_code >= 500:
            self.errors.append(f"{op}: {response.status_code} {response.text[:200]}")
        elif LOCKED in response.text:
            self.errors.append(f"{op}: {LOCKED}")

    def summary(self) -> dict:
        ops = {}
        for op, values in sorted(self.latencies.items()):
            ms = sorted(v * 1000 for v in values)
            q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
            statuses = {str(k): v for k, v in sorted(self.statuses[op].items())}
            ops[op] = {"count": len(ms), "p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1),
                       "max_ms": round(ms[-1], 1), "statuses": statuses}
        server_errors = sum(n for c in self.statuses.values() for s, n in c.items() if s >= 500)
        return {"requests": self.requests, "server_errors": server_errors, "errors": len(self.errors),
                "first_errors": self.errors[:10], "operations": ops}


async def _client(index: int, base_url: str, key: str, deadline: float, max_requests: int, results: Results,
                  rng: random.Random) -> None:
    """One client on its own connection: a create first (so it has ids to retrieve), then the mix."""
    file_ids: list[str] = []
    batch_ids: list[str] = []
    ops, weights = list(MIX), list(MIX.values())
    async with httpx.AsyncClient(base_url=f"{base_url}/v1", headers={"Authorization": f"Bearer {key}"},
                                 timeout=60) as http:

        async def call(op: str, method: str, url: str, **kwargs) -> httpx.Response | None:
            start = time.perf_counter()
            try:
                response = await http.request(method, url, **kwargs)
            except httpx.HTTPError as exc:
                results.requests += 1
                results.errors.append(f"{op}: {type(exc).__name__}: {exc}")
                return None
            results.record(op, response, time.perf_counter() - start)
            return response

        op = "create"
        while time.monotonic() < deadline and results.requests < max_requests:
            if op == "create":
                files = {"file": (f"load-{index}.jsonl", _input_file(index, rng.randint(1, 20)), "application/jsonl")}
                uploaded = await call("upload", "POST", "/files", data={"purpose": "batch"}, files=files)
                if uploaded is not None and uploaded.status_code == 200:
                    file_ids.append(uploaded.json()["id"])
                    created = await call("create", "POST", "/batches", json={
                        "input_file_id": file_ids[-1], "endpoint": "/v1/chat/completions",
                        "completion_window": "24h", "metadata": {"client": str(index)}})
                    if created is not None and created.status_code == 200:
                        batch_ids.append(created.json()["id"])
            elif op == "list_batches":
                await call(op, "GET", "/batches", params={"limit": rng.choice([5, 20, 100])})
            elif op == "retrieve_batch" and batch_ids:
                await call(op, "GET", f"/batches/{rng.choice(batch_ids)}")
            elif op == "list_files":
                await call(op, "GET", "/files", params={"limit": 50})
            elif op == "retrieve_file" and file_ids:
                await call(op, "GET", f"/files/{rng.choice(file_ids)}")
            op = rng.choices(ops, weights)[0]


async def _load(base_url: str, key: str, clients: int, duration_s: float, max_requests: int, seed: int) -> Results:
    results = Results()
    deadline = time.monotonic() + duration_s
    await asyncio.gather(*(_client(i, base_url, key, deadline, max_requests, results, random.Random(seed + i))
                           for i in range(clients)))
    return results


def run_load(base_url: str, key: str, *, clients: int = 32, duration_s: float = 60, max_requests: int = 200_000,
             seed: int = 13) -> dict:
    """Load a running API; the summary (requests, server_errors, errors, per-operation latencies)."""
    started = time.monotonic()
    results = asyncio.run(_load(base_url, key, clients, duration_s, max_requests, seed))
    summary = results.summary()
    summary.update(clients=clients, duration_s=round(time.monotonic() - started, 1))
    return summary


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")


@contextmanager
def serve(database_url: str | None, workdir: Path):
    """`python -m batch_dagster.serve --no-ui` in `workdir` with a test key; yields (API URL, log path)."""
    home, data = workdir / "dagster_home", workdir / "data"
    home.mkdir(parents=True, exist_ok=True)
    # The project's instance config, with runs queued one at a time.
    config = INSTANCE_CONFIG.read_text().replace(
        "concurrency:\n  runs:\n", "concurrency:\n  runs:\n    max_concurrent_runs: 1\n", 1)
    assert "max_concurrent_runs: 1" in config, "the repo's dagster.yaml has no concurrency.runs block"
    (home / "dagster.yaml").write_text(config)
    # serve gets only the settings below: none of the caller's own (it reads them itself, through settings.py).
    env = {k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES)}
    # One key makes every request: its per-key limits off (they would answer 429 past 100 unfinished batches, or past
    # 4 uploads at once), since this measures the API's latency, not the limits.
    settings = {"DAGSTER_HOME": str(home), "BATCH_DATA_DIR": str(data), "BATCH_API_KEYS": LOAD_KEY,
                "BATCH_KEY_MAX_ACTIVE_BATCHES": "0", "BATCH_KEY_MAX_STORED_BYTES": "0", "BATCH_KEY_MAX_UPLOADS": "0"}
    if database_url:
        settings["BATCH_DATABASE_URL"] = database_url
    env.update(settings)
    port = _free_port()
    log_path = workdir / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "batch_dagster.serve", "--no-ui", "--port", str(port)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                _wait_http(f"http://127.0.0.1:{port}/health", proc, 120)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}; serve's log:\n{log_path.read_text(errors='replace')[-3000:]}") from None
            yield f"http://127.0.0.1:{port}", log_path
        finally:
            stop_service(proc)


def run_on(db: str, *, clients: int, duration_s: float, max_requests: int, seed: int = 13,
           database_url: str | None = None) -> dict:
    """serve on `db` ("sqlite", or "postgres": `database_url` or a throwaway server), loaded; the summary, with
    what serve's log says (lock errors, tracebacks)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"batch-load-{db}-"))
    try:
        with ExitStack() as stack:
            url = database_url
            if db == "postgres" and url is None:
                url = stack.enter_context(TempPostgres()).url
            base_url, log_path = stack.enter_context(serve(url, workdir))
            summary = run_load(base_url, LOAD_KEY, clients=clients, duration_s=duration_s,
                               max_requests=max_requests, seed=seed)
            log = log_path.read_text(errors="replace")
        summary["database"] = db
        summary["log_locked"] = log.count(LOCKED)
        summary["log_tracebacks"] = log.count("Traceback")
        return summary
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def print_summary(summary: dict) -> None:
    print(f"\n{summary.get('database', summary.get('url', ''))}: {summary['requests']} requests in "
          f"{summary['duration_s']} s from {summary['clients']} clients; 5xx: {summary['server_errors']}, "
          f"errors: {summary['errors']}, 'database is locked' in the log: {summary.get('log_locked', '-')}")
    print(f"  {'operation':<16}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}  statuses")
    for op, s in summary["operations"].items():
        print(f"  {op:<16}{s['count']:>8}{s['p50_ms']:>10}{s['p99_ms']:>10}{s['max_ms']:>10}  {s['statuses']}")
    for error in summary["first_errors"]:
        print(f"  ! {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60, help="seconds of load")
    parser.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests")
    parser.add_argument("--url", help="load this running API instead of starting serve")
    parser.add_argument("--key", default=LOAD_KEY, help="the API key, with --url")
    parser.add_argument("--out", type=Path, help="write the summaries here as JSON")
    args = parser.parse_args(argv)
    if args.url:
        summaries = [run_load(args.url, args.key, clients=args.clients, duration_s=args.duration,
                              max_requests=args.max_requests) | {"url": args.url}]
    else:
        dbs = ("sqlite", "postgres") if args.db == "both" else (args.db,)
        summaries = [run_on(db, clients=args.clients, duration_s=args.duration, max_requests=args.max_requests)
                     for db in dbs]
    for summary in summaries:
        print_summary(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summaries, indent=2) + "\n")
    failed = any(s["server_errors"] or s["errors"] or s.get("log_locked") for s in summaries)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
