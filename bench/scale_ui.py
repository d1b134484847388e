"""The Dagster UI over many batch partitions (bench/scale.py's `ui` part): a real dagster-webserver on this project's
definitions, its pages opened in headless Chromium (Playwright) to capture the GraphQL queries they send, each query
then replayed alone and timed, and the asset's partitions page timed until its partition list has rendered.

The partitions are added as the launch sensor adds them (instance.add_dynamic_partitions), without runs or
materializations: this measures what the partition count alone costs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.api_load import OWN_PREFIXES
from bench.measure import stop_group
from bench.postgres import _free_port
from bench.scale import REPO, Sizes, Stores

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
LOCATION = "batch_dagster.definitions"
ASSET = "batch_input"  # a batch-partitioned asset (defs/assets/batch.py)
JOB = "batch_job"
REPLAYS = 3  # each captured query is replayed this many times; the median is kept
PAGE_TIMEOUT_MS = 120_000
SETTLE_S = 20.0
PAGES = {  # name -> path; the launch-backfill dialog is opened from the job's partitions page
    "asset_partitions": f"/assets/{ASSET}?view=partitions",
    "job_partitions": f"/locations/{LOCATION}/jobs/{JOB}/partitions",
    "lineage": f"/assets/{ASSET}?view=lineage",
}


@contextmanager
def webserver(s: Stores) -> Iterator[str]:
    """dagster-webserver on a free loopback port over `s`'s instance and store; yields its URL."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES)}  # the caller's own are not passed
    env.update(DAGSTER_HOME=str(s.dagster_home), BATCH_DATABASE_URL=s.store_url, BATCH_DATA_DIR=str(s.data_dir),
               PYTHONPATH=str(REPO))
    log = open(s.dagster_home / "webserver.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("dagster-webserver")), "-h", "127.0.0.1",
                             "-p", str(port), "-m", LOCATION], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/server_info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dagster-webserver did not start: "
                                   + (s.dagster_home / "webserver.log").read_text(errors="replace")[-2000:])
            time.sleep(0.5)
        yield url
    finally:
        stop_group(proc)
        log.close()


def recording_proxy(target: str, log: list[dict]):
    """An ASGI reverse proxy to `target` that records each GraphQL POST (its body, seconds and answer's bytes). The UI
    sends its queries from a web worker, which Playwright's request events do not see; its websocket (run-log
    subscriptions, unused by these pages) is refused."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route, WebSocketRoute

    # No kept-alive connections: the webserver closes idle ones after 5 s, and a reused closed one fails the request.
    client = httpx.AsyncClient(base_url=target, timeout=600, limits=httpx.Limits(max_keepalive_connections=0))
    dropped = ("host", "content-length", "accept-encoding")

    async def forward(request):
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        t0 = time.perf_counter()
        answer = await client.request(request.method, path, content=body,
                                      headers={k: v for k, v in request.headers.items() if k.lower() not in dropped})
        if request.method == "POST" and request.url.path == "/graphql":
            log.append({"at": time.perf_counter(), "body": json.loads(body), "s": time.perf_counter() - t0,
                        "bytes": len(answer.content)})
        headers = {k: v for k, v in answer.headers.items()
                   if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")}
        return Response(answer.content, status_code=answer.status_code, headers=headers)

    async def refuse(websocket):
        await websocket.close()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[WebSocketRoute("/{path:path}", refuse), Route("/{path:path}", forward, methods=methods)])


def settle(log: list[dict], quiet_s: float = 1.0, limit_s: float = SETTLE_S) -> None:
    """Wait until no GraphQL query has been answered for `quiet_s` (the page's queries are done), at most `limit_s`
    (the UI also polls)."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        last = log[-1]["at"] if log else 0.0
        if time.perf_counter() - last >= quiet_s:
            return
        time.sleep(0.2)


def capture(page, base: str, log: list[dict], path: str, wait_for: str, click: str | None = None) -> tuple[dict, float]:
    """Open `path` (then click the button named `click`, if any); the GraphQL operations sent meanwhile, by name, and
    the seconds until `wait_for` was visible."""
    page.goto(base + path, timeout=PAGE_TIMEOUT_MS)
    if click:
        page.get_by_role("button", name=click).first.wait_for(state="visible", timeout=PAGE_TIMEOUT_MS)
        settle(log)
    first = len(log)
    t0 = time.perf_counter()
    if click:
        page.get_by_role("button", name=click).first.click(timeout=PAGE_TIMEOUT_MS)
    else:
        page.goto(base + path, timeout=PAGE_TIMEOUT_MS)  # again: the first load also fetched the app's bundle
    page.locator(wait_for).first.wait_for(state="visible", timeout=PAGE_TIMEOUT_MS)
    seconds = time.perf_counter() - t0
    settle(log)
    sent: dict[str, dict] = {}
    for entry in log[first:]:
        sent.setdefault(entry["body"].get("operationName") or "anonymous", entry)
    return sent, seconds


def replay(url: str, body: dict) -> float:
    """The median seconds of REPLAYS posts of a captured GraphQL body, straight to the webserver."""
    times = []
    with httpx.Client(timeout=600) as client:
        for _ in range(REPLAYS):
            t0 = time.perf_counter()
            client.post(f"{url}/graphql", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# name, path, what shows the page rendered, the button that opens it (the launch-backfill dialog is the job's)
STEPS = [("asset_partitions", PAGES["asset_partitions"], "text=/batch_scale0/", None),
         ("job_partitions", PAGES["job_partitions"], "text=Missing partitions", None),
         ("launch_backfill", PAGES["job_partitions"], "[role=dialog]", "Materialize…"),
         ("lineage", PAGES["lineage"], "text=batch_input", None)]


def measure_ui(url: str) -> dict:
    """Each page's GraphQL operations (as the browser saw them answered, and replayed alone) and its render time."""
    from playwright.sync_api import sync_playwright

    from tests.helpers import ApiServer

    log: list[dict] = []
    queries: dict[str, dict] = {}
    rendered: dict[str, float | str] = {}
    with ApiServer(recording_proxy(url, log)) as proxy, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            for name, path, wait_for, click in STEPS:
                try:
                    sent, seconds = capture(page, proxy.url, log, path, wait_for, click)
                except Exception as exc:  # a page that does not render in time: said, and the others still measured
                    rendered[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    continue
                rendered[name] = round(seconds, 2)
                print(f"      {name}: {len(sent)} queries, rendered in {seconds:.2f} s", flush=True)
                for op, entry in sent.items():
                    queries[f"{name}.{op}"] = {"browser_s": round(entry["s"], 3), "bytes": entry["bytes"],
                                               "body": entry["body"]}
        finally:
            browser.close()
    for query in queries.values():
        query["s"] = round(replay(url, query.pop("body")), 3)
    return {"rendered_s": rendered, "queries": queries, "queries_s": {n: q["s"] for n, q in queries.items()},
            "slowest_query_s": max((q["s"] for q in queries.values()), default=None)}


def bench_ui(s: Stores, sizes: Sizes) -> dict:
    """For each count in `sizes.partitions` (growing; partitions are added between measurements), the UI's pages."""
    if not CHROMIUM.exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: install Chromium (apt-get install -y chromium)")
    out: dict = {"by_partitions": {}}
    with s.instance() as instance:
        have = 0
        with webserver(s) as url:
            for count in sorted(sizes.partitions):
                t0 = time.perf_counter()
                for first in range(have, count, 10_000):
                    keys = [f"batch_scale{i:08d}" for i in range(first, min(first + 10_000, count))]
                    instance.add_dynamic_partitions("batches", keys)
                have = count
                added_s = time.perf_counter() - t0
                out["by_partitions"][str(count)] = {"add_partitions_s": round(added_s, 1), **measure_ui(url)}
                print(f"    ui {count} partitions: slowest query "
                      f"{out['by_partitions'][str(count)]['slowest_query_s']} s", flush=True)
    return out
