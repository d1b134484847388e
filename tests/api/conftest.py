"""The API served on loopback by uvicorn, the openai SDK as its client, and a worker that plays the daemon.

The worker evaluates the project's sensors against a test Dagster instance and executes the runs
they request in-process, so every batch really goes through batch_job, on the fake engine unless
a test passes another vLLM resource.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import httpx
import pytest
import uvicorn
from openai import OpenAI

from batch_dagster.api.app import create_app
from batch_dagster.api.config import ApiConfig
from batch_dagster.resources import BatchStorage, VLLMResource
from batch_dagster.sensors import api_batch_sensor, api_batch_status_sensor
from batch_dagster.settings import Settings
from batch_dagster.store.resource import ApiStore

from ..conftest import chat_request, free_port, make_defs, write_jsonl
from ..fakes import FAKES, FakeEngine, FakeVLLM

KEY_A, KEY_B = "sk-test-a", "sk-test-b"
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def fake_vllm(name: str, engine: FakeEngine, cls: type[FakeVLLM] = FakeVLLM) -> FakeVLLM:
    FAKES[name] = engine
    return cls(models_file=str(Settings.from_env().models_file), model_cache_dir="/nonexistent", fake=name)


class Worker(threading.Thread):
    """Plays the Dagster daemon: ticks the sensors and runs each requested partition of batch_job."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance, resources: dict, interval_s: float = 0.2):
        super().__init__(daemon=True, name="dagster-worker")
        self.defs, self.instance, self.resources, self.interval_s = defs, instance, resources, interval_s
        self.stopping = threading.Event()
        self.ran: list[str] = []
        self.errors: list[BaseException] = []

    def tick(self) -> None:
        result = api_batch_sensor(dg.build_sensor_context(instance=self.instance, resources=self.resources))
        if isinstance(result, dg.SensorResult):
            for request in result.dynamic_partitions_requests or []:
                self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            for run in result.run_requests or []:
                self.defs.resolve_job_def("batch_job").execute_in_process(
                    partition_key=run.partition_key, instance=self.instance, raise_on_error=False,
                    tags={**run.tags, "dagster/run_key": run.run_key},  # as the daemon tags a sensor's run
                    run_config=QUIET,
                )
                self.ran.append(run.partition_key)
        api_batch_status_sensor(dg.build_sensor_context(instance=self.instance, resources=self.resources))

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick()
            except BaseException as exc:  # surfaced by the fixture's teardown
                self.errors.append(exc)
                return
            self.stopping.wait(self.interval_s)


class ApiServer:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Service:
    url: str
    data_dir: Path
    config: ApiConfig
    engine: FakeEngine
    worker: Worker
    instance: dg.DagsterInstance
    storage: BatchStorage
    clients: list[OpenAI] = field(default_factory=list)

    def client(self, api_key: str = KEY_A) -> OpenAI:
        client = OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)
        self.clients.append(client)
        return client

    def http(self, api_key: str | None = KEY_A) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def start_worker(self) -> None:
        if not self.worker.is_alive():
            self.worker.start()


def database_url(data_dir: Path) -> str:
    """SQLite in the test's folder; BATCH_TEST_DATABASE_URL (e.g. a Postgres URL) runs the tests there, emptied first."""
    url = os.environ.get("BATCH_TEST_DATABASE_URL")
    if not url:
        return f"sqlite:///{data_dir / 'api.db'}"
    from sqlalchemy import text

    from batch_dagster.store import Store
    from batch_dagster.store.models import Base

    store = Store(url)
    Base.metadata.drop_all(store.engine)
    with store.engine.begin() as connection:
        connection.execute(text("DROP TABLE IF EXISTS alembic_version"))
    store.dispose()
    return url


@pytest.fixture
def start_service(tmp_path, monkeypatch) -> Callable[..., Service]:
    """Start the API (and, unless told not to, the worker) with the given configuration."""
    stack = ExitStack()
    services: list[Service] = []

    def start(*, api_keys=(KEY_A, KEY_B), window_s: int = 86_400, shard_size: int = 2,
              max_upload_bytes: int = 10 * 1024 * 1024, vllm: VLLMResource | None = None,
              engine: FakeEngine | None = None, worker: bool = True) -> Service:
        data_dir = tmp_path / "data"
        monkeypatch.setenv("BATCH_DATA_DIR", str(data_dir))
        monkeypatch.setenv("BATCH_SHARD_SIZE", str(shard_size))
        config = ApiConfig(api_keys=tuple(api_keys), database_url=database_url(data_dir),
                           data_dir=data_dir, max_upload_bytes=max_upload_bytes, completion_window_s=window_s)
        engine = engine or FakeEngine()
        vllm = vllm or fake_vllm(f"api-{tmp_path.name}", engine)
        instance = stack.enter_context(dg.instance_for_test())
        storage = BatchStorage(data_dir=str(data_dir))
        resources = {"api_store": ApiStore(url=config.database_url), "storage": storage}
        server = stack.enter_context(ApiServer(create_app(config)))
        service = Service(server.url, data_dir, config, engine, Worker(make_defs(data_dir, vllm), instance, resources),
                          instance, storage)
        services.append(service)
        if worker:
            service.start_worker()
        return service

    yield start
    for service in services:
        service.worker.stopping.set()
        if service.worker.is_alive():
            service.worker.join(60)
        for client in service.clients:
            client.close()
    stack.close()
    for service in services:
        if service.worker.errors:
            raise service.worker.errors[0]


def upload(client: OpenAI, path: Path, rows: list) -> str:
    write_jsonl(path, rows)
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def wait_for(client: OpenAI, batch_id: str, statuses: set[str] | str, timeout_s: float = 60,
             seen: list[str] | None = None):
    """Poll a batch until its status is one of `statuses`; records each status seen on the way."""
    statuses = {statuses} if isinstance(statuses, str) else statuses
    deadline = time.time() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != batch.status):
            seen.append(batch.status)
        if batch.status in statuses:
            return batch
        if time.time() > deadline:
            raise TimeoutError(f"{batch_id} is still {batch.status} (waiting for {statuses})")
        time.sleep(0.1)


def rows(n: int, prefix: str = "r", **params) -> list[dict]:
    return [chat_request(f"{prefix}{i}", f"question {i} " + "word " * i, **params) for i in range(n)]
