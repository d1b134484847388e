"""Small-batch latency: a 3-request chat batch through the API on the warm fleet, its fixed cost, and vLLM's run_batch.

`python -m batch_dagster.serve --no-ui` runs with its defaults (a warm fleet of the default chat model,
1 replica here) in a fresh DAGSTER_HOME and data folder. A first batch warms the daemon and its code
server and is not counted; then each batch is uploaded, and timed with the openai SDK from
`batches.create` until `batches.retrieve` answers `completed`. Just before and just after each, the same requests'
bodies go straight to the fleet's replica, all at once (the engine's own time for them, on the same warm server; the
mean of the two): the batch's fixed cost is its time less that one. Where the time went comes from the run's Dagster
event log (bench/fleet_report.py names the phases). run_batch runs on the same file with the same engine settings,
wall time from launch to exit, engine start included: that is what a user without a warm engine waits
(BENCH_FLEET_RUN_BATCH=0 leaves it out).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from batch_dagster.serve import fleet
from bench.api_load import OWN_PREFIXES, _free_port, _wait_http
from bench.fleet_report import latency_phases, median, median_phases
from bench.fleet_scaling import free_port_block
from bench.measure import run_measured, stop_service, wait_for_quiet

REPO = Path(__file__).resolve().parent.parent
KEY = "bench-small-batch-key"
READY_LINE = "warm fleet:"  # serve logs it once its fleet answers; the daemon starts right after
POLL_S = 0.1


@contextmanager
def serve(work: Path, model_cache: Path, settings: dict[str, str] | None = None,
          fleet_port: int | None = None) -> Iterator[tuple[str, Path, Path]]:
    """serve with its defaults (warm fleet included) in `work`, but the `settings` given, its fleet's ports from
    `fleet_port` (a free block if none); yields (API base URL, DAGSTER_HOME, log path)."""
    home, data = work / "dagster_home", work / "data"
    own = OWN_PREFIXES
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    env.update({"DAGSTER_HOME": str(home), "BATCH_DATA_DIR": str(data), "BATCH_MODEL_CACHE": str(model_cache),
                "BATCH_API_KEYS": KEY, "BATCH_FLEET_PORT": str(fleet_port or free_port_block(fleet.block_size(1))),
                **(settings or {})})
    port = _free_port()
    log_path = work / "serve.log"
    with open(log_path, "w") as log:
        # In `work`, which has no workspace.yaml: serve loads the installed package's definitions.
        proc = subprocess.Popen([sys.executable, "-m", "batch_dagster.serve", "--no-ui", "--port", str(port)],
                                cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", proc, 120)
            deadline = time.monotonic() + 600
            while READY_LINE not in log_path.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve's fleet did not start; log:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1", home, log_path
        finally:
            stop_service(proc)


def api_batch(client: Any, path: Path, timeout_s: float = 600) -> tuple[str, float, float, str]:
    """Upload `path`, create its batch and poll it to an end: (batch id, created at, ended at, status)."""
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    created = time.time()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.time() - created > timeout_s:
            raise TimeoutError(f"{batch.id} still {batch.status} after {timeout_s:.0f} s")
        time.sleep(POLL_S)
        batch = client.batches.retrieve(batch.id)
    return batch.id, created, time.time(), batch.status


def engine_time(replica_url: str, path: Path, timeout_s: float = 600) -> float:
    """The engine's own time for the batch's requests: their bodies as the engine gets them from the pipeline (each
    with its owner's cache_salt: serve's key's, no secret) sent at once straight to a warm replica, as the pipeline's
    server engine sends a shard's, until the last answer is back."""
    import asyncio

    import httpx

    from batch_dagster.db.repo import owner_of_key
    from batch_dagster.features.scope import Owner, salted, scope
    from batch_dagster.settings import default

    requests = [(line["custom_id"], line["body"]) for line in map(orjson.loads, path.read_bytes().splitlines())]
    # On one start of the replica the same three requests took 4.4 s unsalted and 5.9 to 6.3 s salted; on others both
    # alike (docs/performance.md, "The run worker's imports, a nudge during a tick, and the engine's own time").
    # serve runs with its defaults here (serve() leaves out the caller's own settings): those of the salt's too.
    owners_scope = scope(Owner(owner_of_key(KEY)), default("BATCH_SHARED_OWNERS"), "")
    bodies = [body for _, body in salted(requests, owners_scope, default("BATCH_CACHE_SALT_SECRET"))]

    async def send_all() -> float:
        async with httpx.AsyncClient(base_url=replica_url, timeout=timeout_s) as client:
            started = time.perf_counter()
            answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            elapsed = time.perf_counter() - started
        for answer in answers:
            answer.raise_for_status()
        return elapsed

    return round(asyncio.run(send_all()), 3)


@contextmanager
def dagster_instance(home: Path) -> Iterator[Any]:
    """The Dagster instance in `home`, read from this process (its dagster.yaml reads DAGSTER_HOME)."""
    import dagster as dg

    saved = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield instance
    finally:
        if saved is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = saved


def run_events(home: Path, batch_id: str, timeout_s: float = 60) -> tuple[str, list[tuple[float, str, str | None]]]:
    """The batch's (last) run id and its events as (timestamp, event type, step key), once the run has ended."""
    import dagster as dg

    with dagster_instance(home) as instance:
        deadline = time.time() + timeout_s
        while True:
            runs = instance.get_runs(dg.RunsFilter(job_name="batch_job", tags={"dagster/partition": batch_id}),
                                     limit=1)
            if (runs and runs[0].is_finished) or time.time() > deadline:
                break
            time.sleep(0.5)
        if not runs:
            raise RuntimeError(f"no run of batch_job for {batch_id}")
        events = [(e.timestamp, e.dagster_event.event_type.name, e.dagster_event.step_key)
                  for e in instance.all_logs(runs[0].run_id) if e.dagster_event is not None]
    return runs[0].run_id, events


def run_batch_wall(input_path: Path, work: Path, spec: Any, model_path: str, i: int) -> float:
    from bench.run_bench import run_batch_command

    log = work / f"run_batch-{i}.log"
    m = run_measured(run_batch_command(spec, model_path, input_path, work / f"run_batch-{i}.output.jsonl"),
                     env={"VLLM_LOGGING_LEVEL": "INFO"}, cwd=REPO, log_path=log, timeout_s=1800)
    if m.returncode != 0:
        raise RuntimeError(f"run_batch exited with {m.returncode}; log {log}:\n{m.tail()}")
    return round(m.wall_s, 2)


def measure(input_path: Path, work: Path, spec: Any, model_path: str, model_cache: Path, *, repeats: int,
            quiet_wait_s: float, run_batch: bool = True) -> dict[str, Any]:
    """run_batch `repeats` times (if `run_batch`), then serve with a warm fleet and `repeats` API batches after a
    warm-up one, each after the engine's own time for the same requests on the fleet's replica."""
    from openai import OpenAI

    work.mkdir(parents=True, exist_ok=True)
    requests = sum(1 for _ in open(input_path, "rb"))
    baseline = []
    for i in range(repeats if run_batch else 0):
        wait_for_quiet(quiet_wait_s)
        print(f"bench-fleet: small batch, run_batch {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
        baseline.append(run_batch_wall(input_path, work, spec, model_path, i))
    wait_for_quiet(quiet_wait_s)
    print("bench-fleet: small batch, starting serve with its warm fleet ...", file=sys.stderr, flush=True)
    batches: list[dict[str, Any]] = []
    phases_each: list[dict[str, float]] = []
    serve_dir = work / "serve"
    serve_dir.mkdir()
    fleet_port = free_port_block(fleet.block_size(1))
    replica_url = f"http://127.0.0.1:{fleet_port + 1}"  # the fleet's one replica, behind its router on fleet_port
    with serve(serve_dir, model_cache, fleet_port=fleet_port) as (url, home, log_path):
        client = OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        warm_id, *_ = api_batch(client, input_path)
        engine_time(replica_url, input_path)  # warms the direct path as the warm-up batch warmed the API's
        for i in range(repeats):
            engine_before = engine_time(replica_url, input_path)
            batch_id, created, seen, status = api_batch(client, input_path)
            engine_after = engine_time(replica_url, input_path)
            # Either side of the batch: a machine whose load moves (other work on its cores) moves both alike.
            engine_s = round((engine_before + engine_after) / 2, 3)
            run_id, events = run_events(home, batch_id)
            if status != "completed":
                raise RuntimeError(f"{batch_id} ended {status}; serve's log {log_path}")
            total = round(seen - created, 3)
            phases = latency_phases(created, seen, events)
            fixed = round(total - engine_s, 3)
            print(f"bench-fleet: small batch {i + 1}/{repeats} through the API: {total} s, engine alone {engine_s} s, "
                  f"fixed cost {fixed} s ({', '.join(f'{k} {v:.1f}' for k, v in phases.items() if v >= 0.05)})",
                  file=sys.stderr, flush=True)
            batches.append({"batch_id": batch_id, "run_id": run_id, "created_at": created, "seen_at": seen,
                            "total_s": total, "engine_s": engine_s,
                            "engine_each_s": [engine_before, engine_after], "fixed_s": fixed, "phases_s": phases})
            phases_each.append(phases)
    return {
        "requests": requests,
        "api": batches,
        "warm_up_batch": warm_id,
        "api_median_s": median([b["total_s"] for b in batches]),
        "engine_median_s": median([b["engine_s"] for b in batches]),
        "fixed_median_s": median([b["fixed_s"] for b in batches]),
        "phases_median_s": median_phases(phases_each),
        "run_batch_wall_s": baseline,
        "run_batch_median_s": median(baseline),
    }
