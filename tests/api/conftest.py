"""The API served on loopback by uvicorn, the openai SDK as its client, and a worker that plays the daemon.

The worker evaluates the project's sensors against a test Dagster instance and executes the runs
they request in-process, so every batch really goes through batch_job, on the fake engine unless
a test passes another vLLM resource. The pieces are in tests/helpers.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from batch_dagster.api import metrics
from batch_dagster.api.app import create_app
from batch_dagster.defs.resources import DatabaseResource, StorageResource, VLLMResource
from batch_dagster.engine.models import Models
from batch_dagster.settings import Settings
from tests.helpers import (
    KEY_A,
    KEY_B,
    ApiServer,
    FakeEngine,
    Service,
    WordTokenizer,
    Worker,
    dagster_instance,
    database_url,
    fake_vllm,
    make_defs,
)


@pytest.fixture(autouse=True)
def word_tokenizer(monkeypatch):
    """Every model's tokens are counted as the fake engine counts them (the estimate, the cost cap and the token
    limit count them at validation): exact for these tests, and no tokenizer to load."""
    monkeypatch.setattr(Models, "tokenizer", lambda self, model: WordTokenizer())


@contextmanager
def serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Service]]:
    """How to start the API (and, unless told not to, the worker) with a configuration; all stopped at the end."""
    stack = ExitStack()
    services: list[Service] = []

    def start(*, api_keys=(KEY_A, KEY_B), window_s: int = 86_400, shard_size: int = 2,
              max_upload_bytes: int = 10 * 1024 * 1024, max_json_body_bytes: int = 1 << 20,
              vllm: VLLMResource | None = None, engine: FakeEngine | None = None, worker: bool = True,
              storage_url: str = "", webhook_allow: tuple[str, ...] = (), step_logs: bool = False,
              events_on_disk: bool = False, **settings) -> Service:
        data_dir = tmp_path / "data"
        monkeypatch.setenv("BATCH_DATA_DIR", str(data_dir))
        # window_s: the 24h window's real length (and the 1h window a 24th of it), unless completion_windows is given.
        windows = settings.pop("completion_windows", (f"1h={max(window_s // 24, 1)}", f"24h={window_s}"))
        config = replace(Settings.from_env(), api_keys=tuple(api_keys), database_url=database_url(data_dir),
                         storage_url=storage_url or str(data_dir), max_upload_bytes=max_upload_bytes,
                         completion_windows=windows, max_json_body_bytes=max_json_body_bytes,
                         webhook_allow=tuple(webhook_allow), **settings)  # settings: any other Settings field
        engine = engine or FakeEngine()
        vllm = vllm or fake_vllm(f"api-{tmp_path.name}", engine)
        storage = StorageResource(data_dir=str(data_dir), url=storage_url)
        # The pipeline reads the API's store, as under serve (the cost cap asks it what a key spent).
        defs = make_defs(data_dir, vllm, shard_size, storage_url, database_url=config.database_url,
                         key_daily_budget=config.key_daily_budget, error_breaker_lines=config.error_breaker_lines,
                         error_breaker_rate=config.error_breaker_rate,
                         reuse_answers=config.reuse_answers, shared_owners=list(config.shared_owners),
                         image_hosts=list(config.image_hosts), fetch_allow=list(config.webhook_allow),
                         max_image_bytes=config.max_image_bytes, key_max_stored_bytes=config.key_max_stored_bytes)
        resources = {"database": DatabaseResource(url=config.database_url), "storage": storage, "vllm": vllm,
                     "pipeline": defs.resources["pipeline"]}
        app = create_app(config)
        server = stack.enter_context(ApiServer(app))
        listener = metrics.serve(app, "127.0.0.1", 0)  # the operator's listener, as `python -m batch_dagster.api`'s
        stack.callback(listener.close)
        # The Dagster instance is opened when first used (a third of a second): many tests only need the API.
        daemon = Worker(defs, lambda: stack.enter_context(dagster_instance(step_logs, events_on_disk)), resources)
        service = Service(server.url, data_dir, config, engine, daemon, storage, metrics_url=listener.url)
        services.append(service)
        if worker:  # (`worker=False`: the test starts it when it wants, or never)
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


@pytest.fixture
def start_service(tmp_path, monkeypatch) -> Iterator[Callable[..., Service]]:
    """Start the API (and, unless told not to, the worker) with the given configuration."""
    with serving(tmp_path, monkeypatch) as start:
        yield start


@pytest.fixture(scope="module")
def shared_service(tmp_path_factory) -> Iterator[Callable[..., Service]]:
    """The API without a worker, one per configuration, shared by a module's tests that only send requests and read
    the answers, leaving nothing that another test reads (a test per refused input, say): starting the API and its
    store was most of such a test's time."""
    started: dict[str, Service] = {}
    with pytest.MonkeyPatch.context() as monkeypatch, ExitStack() as stack:

        def get(**config) -> Service:
            key = repr(sorted(config.items()))
            if key not in started:
                start = stack.enter_context(serving(tmp_path_factory.mktemp("shared-api"), monkeypatch))
                started[key] = start(worker=False, **config)
            return started[key]

        yield get
