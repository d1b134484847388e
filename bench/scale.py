"""The control plane at volume, without inference (`make bench-scale`): the API over a large store, the API sensors'
ticks over a large backlog, the instance's growth per batch, storage calls per tick on S3 (moto), and the Dagster UI
over many batch partitions (bench/scale_ui.py). SQLite and a throwaway PostgreSQL 15 side by side.

    python -m bench.scale [--db sqlite|postgres|both] [--parts api,sensors,growth,s3,ui] [--out FILE]

Sizes come from the environment: SCALE_BATCHES (stored batches for the API, default 100000) across SCALE_KEYS keys
(50), SCALE_ACTIVE (queued, then in-progress batches for the sensors, 2000), SCALE_PARTITIONS (batch partitions for
the UI, 1000,10000,100000), SCALE_S3_ACTIVE (in-progress batches on S3, 500), SCALE_GROWTH (batches run end to end
on the fake engine, 5), SCALE_API_CALLS (timed calls per API operation, 300).
The sensors are evaluated in this process through their public entry points (dg.build_sensor_context), so the
bench measures whichever version of them is in the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import dagster as dg
from sqlalchemy import insert

from batch_dagster.batchfile.folder import BatchFolder, Manifest, Validation
from batch_dagster.batchfile.results import commit_shard, progress_of
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import Database, repo
from batch_dagster.db.models import BatchRecord, FileRecord
from batch_dagster.defs.instance import PG_DRIVER_SCHEME
from bench.postgres import TempPostgres

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "scale.json"
CHAT = "/v1/chat/completions"
SENSOR_TICKS = 3  # timed status-sensor ticks per measurement
CHUNK = 5000  # rows per bulk INSERT


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@dataclass(frozen=True)
class Sizes:
    batches: int
    keys: int
    active: int
    partitions: tuple[int, ...]
    s3_active: int
    growth: int
    api_calls: int

    @classmethod
    def from_env(cls) -> Sizes:
        parts = os.environ.get("SCALE_PARTITIONS", "1000,10000,100000")
        return cls(batches=env_int("SCALE_BATCHES", 100_000), keys=env_int("SCALE_KEYS", 50),
                   active=env_int("SCALE_ACTIVE", 2000), partitions=tuple(int(p) for p in parts.split(",") if p),
                   s3_active=env_int("SCALE_S3_ACTIVE", 500), growth=env_int("SCALE_GROWTH", 5),
                   api_calls=env_int("SCALE_API_CALLS", 300))


def quantiles_ms(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"count": len(ms), "p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1), "max_ms": round(ms[-1], 1)}


# Seeding: bulk INSERTs through the models, not the HTTP API (a hundred thousand creates would take an hour).

def seed_batches(store: Database, owners: list[str], n: int, *, status: str = "completed", launched: bool = True,
                 start: int = 0) -> list[tuple[str, str]]:
    """`n` batch rows (and their input File rows) spread round-robin over `owners`; their (owner, id) in order.
    `launched=False` leaves them for the launch sensor; `status` terminal keeps them out of both sensors' way."""
    with store.session() as session:
        repo.ensure_owners(session, owners)
    made: list[tuple[str, str]] = []
    now = repo.now()
    for first in range(start, start + n, CHUNK):
        files, batches = [], []
        for i in range(first, min(first + CHUNK, start + n)):
            owner, file_id, batch_id = owners[i % len(owners)], f"file-scale{i:08d}", f"batch_scale{i:08d}"
            files.append({"id": file_id, "owner": owner, "bytes": 100, "created_at": now, "expires_at": None,
                          "filename": f"in-{i}.jsonl", "purpose": "batch", "path": f"files/{file_id}",
                          "batch_id": None})
            batches.append({"id": batch_id, "owner": owner, "endpoint": CHAT, "input_file_id": file_id,
                            "completion_window": "24h", "status": status, "created_at": now,
                            "expires_at": now + 86_400, "launched_at": now if launched else None, "request_total": 3,
                            "meta": {"n": str(i)}, "model": "scale-model", "priority": 0})
            made.append((owner, batch_id))
        with store.session() as session:
            session.execute(insert(FileRecord), files)
            session.execute(insert(BatchRecord), batches)
            session.commit()
    return made


def write_in_progress(storage: Storage, batch_id: str, shards: int, committed: int) -> None:
    """A batch folder as a run leaves it mid-inference: validated, cut in `shards`, `committed` of them done."""
    folder = BatchFolder(storage, batch_id)
    folder.write_validation(Validation(valid=True, total_requests=shards * 2, model="scale-model", endpoint=CHAT,
                                       error_count=0, errors=[]))
    folder.write_manifest(Manifest(batch_id=batch_id, endpoint=CHAT, model="scale-model", total_requests=shards * 2,
                                   shard_size=2, shard_count=shards, shard_sizes=[2] * shards))
    done = {index: commit_shard(folder.storage, folder.results_prefix, index, []) for index in range(committed)}
    folder.write_progress(progress_of(done, shards * 2, shards))  # as the inference step writes it after a marker


# The stores: SQLite files, or two databases on one throwaway PostgreSQL 15 (the batch store and Dagster's).

@dataclass
class Stores:
    name: str
    store_url: str
    dagster_home: Path
    data_dir: Path
    dagster_pg_url: str | None = None

    def instance(self) -> dg.DagsterInstance:
        return dg.DagsterInstance.from_config(str(self.dagster_home))


@contextmanager
def stores(db: str, workdir: Path) -> Iterator[Stores]:
    """Fresh, empty stores on `db` under `workdir`, with a DAGSTER_HOME whose dagster.yaml points at them."""
    home, data = workdir / "dagster_home", workdir / "data"
    home.mkdir(parents=True)
    data.mkdir()
    config = "telemetry:\n  enabled: false\nnux:\n  enabled: false\n"
    with ExitStack() as stack:
        if db == "sqlite":
            found = Stores(db, f"sqlite:///{data / 'api.db'}", home, data)
        else:
            pg = stack.enter_context(TempPostgres())
            import psycopg

            with psycopg.connect(pg.url.replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute("CREATE DATABASE dagster")
            dagster_url = pg.url.replace("+psycopg", "").rsplit("/", 1)[0] + "/dagster"
            # dagster-postgres speaks psycopg2, which SQLAlchemy 2.1 only picks when named (defs/instance.py).
            driver_url = PG_DRIVER_SCHEME + dagster_url.removeprefix("postgresql")
            config += f"storage:\n  postgres:\n    postgres_url: {driver_url}\n"
            found = Stores(db, pg.url, home, data, dagster_url)
        (home / "dagster.yaml").write_text(config)
        Database(found.store_url).upgrade()
        yield found


def keys_and_owners(n: int) -> tuple[list[str], list[str]]:
    keys = [f"sk-scale-{i:03d}" for i in range(n)]
    return keys, [repo.owner_of_key(k) for k in keys]


# 1. The API over a large store.

def bench_api(s: Stores, sizes: Sizes) -> dict:
    """Create, retrieve and list, one call at a time, against a store holding `sizes.batches` batches."""
    import httpx

    from batch_dagster.api.app import create_app
    from batch_dagster.settings import Settings
    from tests.helpers import ApiServer

    keys, owners = keys_and_owners(sizes.keys)
    started = time.perf_counter()
    stored = seed_batches(Database(s.store_url), owners, sizes.batches)
    seed_s = time.perf_counter() - started
    # Per-key limits off: they would refuse creates past 100 unfinished batches; this measures latency.
    config = replace(Settings.from_env(), api_keys=tuple(keys), database_url=s.store_url, storage_url=str(s.data_dir),
                     data_dir=s.data_dir, key_max_active_batches=None, key_max_stored_bytes=None)
    rng = random.Random(7)
    latencies: dict[str, list[float]] = {"create": [], "get": [], "list": []}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT,
                       "body": {"model": "scale-model", "messages": [{"role": "user", "content": "hi"}]}}) + "\n"
    with ApiServer(create_app(config)) as server:
        clients = [httpx.Client(base_url=f"{server.url}/v1", headers={"Authorization": f"Bearer {k}"}, timeout=60)
                   for k in keys]

        def timed(op: str, client: httpx.Client, method: str, url: str, **kwargs) -> httpx.Response:
            t0 = time.perf_counter()
            response = client.request(method, url, **kwargs)
            latencies[op].append(time.perf_counter() - t0)
            if response.status_code != 200:
                raise RuntimeError(f"{op} {url}: {response.status_code} {response.text[:300]}")
            return response

        for client in clients[:3]:  # warm-up: the first calls open connections and load the app's caches
            client.get("/batches", params={"limit": 20})
        for i in range(sizes.api_calls):
            k = rng.randrange(len(keys))
            uploaded = clients[k].post("/files", data={"purpose": "batch"},
                                       files={"file": (f"s{i}.jsonl", line.encode(), "application/jsonl")})
            uploaded.raise_for_status()
            timed("create", clients[k], "POST", "/batches", json={
                "input_file_id": uploaded.json()["id"], "endpoint": CHAT, "completion_window": "24h"})
            owner, batch_id = stored[rng.randrange(len(stored))]
            timed("get", clients[owners.index(owner)], "GET", f"/batches/{batch_id}")
            timed("list", clients[rng.randrange(len(keys))], "GET", "/batches", params={"limit": 20})
        for client in clients:
            client.close()
    return {"stored_batches": sizes.batches, "keys": sizes.keys, "seed_s": round(seed_s, 1),
            **{op: quantiles_ms(values) for op, values in latencies.items()}}


# 2. The sensors over a large backlog.

def sensor_resources(s: Stores, storage_url: str = "") -> dict:
    from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource, VLLMResource
    from batch_dagster.settings import Settings

    vllm = VLLMResource(models_file=str(Settings.from_env().models_file), model_cache_dir="/nonexistent")
    return {"database": DatabaseResource(url=s.store_url), "vllm": vllm, "pipeline": PipelineConfig(),
            "storage": StorageResource(data_dir=str(s.data_dir), url=storage_url)}


def tick(sensor, instance: dg.DagsterInstance, resources: dict) -> tuple[float, object]:
    """One evaluation of `sensor` as the daemon calls it, and its seconds (its log lines go to /dev/null)."""
    with quiet():
        t0 = time.perf_counter()
        result = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        return time.perf_counter() - t0, result


def create_runs(instance: dg.DagsterInstance, result, status: dg.DagsterRunStatus) -> None:
    """What the daemon does with a launch tick's result: the partitions added, one run per request (its run key
    and tags as the daemon tags them). The run is created in the run storage (without a job snapshot)."""
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    for r in result.run_requests or []:
        instance.add_run(dg.DagsterRun(job_name="batch_job", status=status, tags={
            **r.tags, "dagster/partition": r.partition_key, "dagster/run_key": r.run_key}))


def bench_sensors(s: Stores, sizes: Sizes) -> dict:
    """A burst of `sizes.active` batches launched tick by tick; then the status sensor over them in progress."""
    from batch_dagster.defs.sensors import api_batch_sensor, api_batch_status_sensor

    _, owners = keys_and_owners(sizes.keys)
    store = Database(s.store_url)
    resources = sensor_resources(s)
    # Finished history under the backlog, as a real store has (a tenth of SCALE_BATCHES, to keep this part quick).
    seed_batches(store, owners, sizes.batches // 10, start=10_000_000)
    burst = seed_batches(store, owners, sizes.active, status="validating", launched=False)
    with s.instance() as instance:
        launch_ticks, runs_s, latency_s = [], [], 0.0
        while True:
            seconds, result = tick(api_batch_sensor, instance, resources)
            if not isinstance(result, dg.SensorResult):
                break
            t0 = time.perf_counter()
            create_runs(instance, result, dg.DagsterRunStatus.STARTED)
            runs_s.append(time.perf_counter() - t0)
            launch_ticks.append(seconds)
            # The daemon starts a sensor's ticks no closer than its minimum interval.
            latency_s += max(api_batch_sensor.minimum_interval_seconds or 0, seconds + runs_s[-1])
        launched = instance.get_runs_count(dg.RunsFilter(job_name="batch_job"))
        assert launched == sizes.active, f"{launched} runs for {sizes.active} batches"
        # In progress: every batch's run has validated its file and cut it in 4 shards, 2 committed.
        folders = resources["storage"].open()
        for _, batch_id in burst:
            write_in_progress(folders, batch_id, shards=4, committed=2)
        status_ticks = [tick(api_batch_status_sensor, instance, resources)[0] for _ in range(SENSOR_TICKS)]
        with store.session() as session:
            moved = Counter(b.status for b in repo.active_batches(session, limit=10 * sizes.active))
    return {"active": sizes.active, "history": sizes.batches // 10,
            "launch_tick_s": {"ticks": len(launch_ticks), "p50": round(statistics.median(launch_ticks), 3),
                              "max": round(max(launch_ticks), 3)},
            "runs_created_per_tick_s": round(statistics.median(runs_s), 3),
            "burst_last_launched_s": round(latency_s, 1),
            "status_tick_s": {"first": round(status_ticks[0], 3), "p50": round(statistics.median(status_ticks), 3),
                              "max": round(max(status_ticks), 3)},
            "statuses_after": dict(moved)}


# 3. The instance's growth per batch, run end to end on the fake engine.

def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def bench_growth(s: Stores, sizes: Sizes) -> dict:
    """`sizes.growth` small batches (10 requests, 2 shards) created through the API and run through batch_job
    in-process with the fake engine, its console log at Dagster's default level (INFO, as serve's runs log); the
    event-log rows and bytes and the step-log bytes they left."""
    import httpx

    from batch_dagster.api.app import create_app
    from batch_dagster.defs.resources import DatabaseResource
    from batch_dagster.defs.sensors import api_batch_sensor, api_batch_status_sensor
    from batch_dagster.settings import Settings
    from tests.helpers import ApiServer, FakeEngine, fake_vllm, make_defs, rows

    keys, _ = keys_and_owners(1)
    config = replace(Settings.from_env(), api_keys=tuple(keys), database_url=s.store_url, storage_url=str(s.data_dir),
                     data_dir=s.data_dir)
    vllm = fake_vllm("scale", FakeEngine())
    defs = make_defs(s.data_dir, vllm, shard_size=5)
    job = defs.resolve_job_def("batch_job")
    resources = {"database": DatabaseResource(url=s.store_url), "storage": defs.resources["storage"], "vllm": vllm,
                 "pipeline": defs.resources["pipeline"]}
    body = "".join(json.dumps(r) + "\n" for r in rows(10)).encode()
    with s.instance() as instance, ApiServer(create_app(config)) as server, httpx.Client(
            base_url=f"{server.url}/v1", headers={"Authorization": f"Bearer {keys[0]}"}, timeout=60) as client:
        logs_dir = s.dagster_home / "storage"
        before_logs, before_disk = _tree_bytes(logs_dir), _dagster_disk_bytes(s)
        for i in range(sizes.growth):
            file_id = client.post("/files", data={"purpose": "batch"},
                                  files={"file": (f"g{i}.jsonl", body, "application/jsonl")}).json()["id"]
            client.post("/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"})
        with quiet():
            result = api_batch_sensor(dg.build_sensor_context(instance=instance, resources=resources))
            assert isinstance(result, dg.SensorResult)
            for request in result.dynamic_partitions_requests or []:
                instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            for r in result.run_requests or []:  # tagged as the daemon tags a sensor's run
                job.execute_in_process(partition_key=r.partition_key, instance=instance, raise_on_error=False,
                                       tags={**(r.tags or {}), "dagster/run_key": r.run_key or ""})
            api_batch_status_sensor(dg.build_sensor_context(instance=instance, resources=resources))
        runs = instance.get_runs(dg.RunsFilter(job_name="batch_job"))
        events, event_bytes = 0, 0
        for run in runs:
            for record in instance.get_records_for_run(run.run_id, limit=100_000).records:
                events += 1
                event_bytes += len(dg.serialize_value(record.event_log_entry))
        statuses = Counter(b["status"] for b in client.get("/batches", params={"limit": 100}).json()["data"])
        n = max(len(runs), 1)
        return {"batches": sizes.growth, "runs": len(runs), "statuses": dict(statuses),
                "event_rows_per_batch": round(events / n, 1), "event_bytes_per_batch": round(event_bytes / n),
                "step_log_bytes_per_batch": round((_tree_bytes(logs_dir) - before_logs) / n),
                "dagster_disk_bytes_per_batch": round((_dagster_disk_bytes(s) - before_disk) / n)}


@contextmanager
def quiet() -> Iterator[None]:
    """This process's stdout and stderr to /dev/null meanwhile: the sensors log a line per batch they move."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def _dagster_disk_bytes(s: Stores) -> int:
    """What Dagster's storage takes on disk: its SQLite files, or its PostgreSQL database."""
    if s.dagster_pg_url is None:
        return _tree_bytes(s.dagster_home / "history")
    import psycopg

    with psycopg.connect(s.dagster_pg_url) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return int(row[0]) if row else 0


PARTS = {"api": bench_api, "sensors": bench_sensors, "growth": bench_growth}


def run_parts(db: str, parts: list[str], sizes: Sizes, results: dict, save) -> dict:
    """Each part on fresh stores of its own (so one part's rows do not weigh on another's) into `results`, saved
    after each part (a part that fails leaves the others' numbers)."""
    results["database"] = db
    for part in parts:
        with tempfile.TemporaryDirectory(prefix=f"batch-scale-{part}-") as tmp:
            started = time.perf_counter()
            if part == "s3":
                from bench.scale_s3 import bench_s3

                with stores(db, Path(tmp)) as s:
                    results[part] = bench_s3(s, sizes)
            elif part == "ui":
                from bench.scale_ui import bench_ui

                with stores(db, Path(tmp)) as s:
                    results[part] = bench_ui(s, sizes)
            else:
                with stores(db, Path(tmp)) as s:
                    results[part] = PARTS[part](s, sizes)
            results[part]["wall_s"] = round(time.perf_counter() - started, 1)
            print(f"  {db} {part}: {results[part]['wall_s']} s", flush=True)
            save()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--parts", default="api,sensors,growth,s3,ui")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: its servers are stopped too (finally blocks)
    sizes = Sizes.from_env()
    parts = [p for p in args.parts.split(",") if p]
    dbs = ("sqlite", "postgres") if args.db == "both" else (args.db,)
    started = time.perf_counter()
    results: dict = {"sizes": sizes.__dict__, "runs": []}

    def save() -> None:
        results["wall_s"] = round(time.perf_counter() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    for db in dbs:
        results["runs"].append({})
        run_parts(db, parts, sizes, results["runs"][-1], save)
    from bench.scale_report import print_table

    save()
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
