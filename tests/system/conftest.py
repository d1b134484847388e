"""Fixtures of the system tier: a real vLLM server and a real PostgreSQL 15, each shared by the whole session."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import CHAT_MODEL, free_port, new_database, real_vllm, stop_group, wait_http

# Fixtures that start a vLLM engine: a test that takes one is on the real engine, and says so (`engine`).
ENGINE_FIXTURES = {"vllm_server"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """`make test` runs this tier as two sessions at once, split by the `engine` marker: the tests on the real engine
    (in their process, a run's, a server's or a fleet's) one after the other, and beside them those that hold none.
    A test that takes a vLLM fixture unmarked would run its engine beside the others'."""
    for item in items:
        if item.get_closest_marker("engine") is None and ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid}: it starts a vLLM engine; mark it `engine`")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM OpenAI-compatible server for the default chat model on loopback, for the session.

    Yields its base URL (without /v1). Started with the registry's settings, as `batch-dagster
    vllm-server` would start it.
    """
    from batch_dagster.engine.server import server_command

    vllm = real_vllm()
    spec = vllm.spec(CHAT_MODEL)
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm-server") / "server.log", "w")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(server_command(spec, vllm.model_path(spec), "127.0.0.1", port), stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", 300, proc)
        yield base
    finally:
        stop_group(proc)
        log.close()


PG_BIN = Path("/usr/lib/postgresql/15/bin")


class Postgres:
    """A throwaway PostgreSQL 15 server: `url` (without a database name), and `restart` for the fault tests."""

    def __init__(self, url: str, pg_ctl: list[str], start: list[str]):
        self.url, self.pg_ctl, self.start = url, pg_ctl, start

    def restart(self, down_s: float = 0) -> None:
        """Stopped as a crash would stop it (immediate: no checkpoint, connections cut), started again `down_s`
        later."""
        subprocess.run([*self.pg_ctl, "-m", "immediate", "-w", "stop"], check=True, capture_output=True)
        time.sleep(down_s)
        subprocess.run(self.start, check=True, capture_output=True)


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL 15 on a loopback port, for the session (a Postgres).

    postgres refuses to run as root, so as root the server runs as the `postgres` user (runuser). Skips only where
    the PostgreSQL 15 server binaries are absent.
    """
    if not PG_BIN.is_dir():
        pytest.skip(f"PostgreSQL 15 server binaries are absent ({PG_BIN})")
    # Not under pytest's tmp dirs: those are private to root, and the postgres user must reach its data dir.
    root = Path(tempfile.mkdtemp(prefix="batch-pg-"))
    data, log, port = root / "data", root / "server.log", free_port()
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_postgres:
        shutil.chown(root, "postgres")
    subprocess.run([*as_postgres, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True)
    pg_ctl = [*as_postgres, str(PG_BIN / "pg_ctl"), "-D", str(data)]
    start = [*pg_ctl, "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "-l", str(log), "-w", "start"]
    subprocess.run(start, check=True, capture_output=True)
    try:
        # The driver named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, dagster-postgres needs psycopg2.
        yield Postgres(f"postgresql+psycopg2://postgres@127.0.0.1:{port}", pg_ctl, start)
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server(postgres) -> str:
    """The session's PostgreSQL 15 server's URL, without a database name."""
    return postgres.url


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A URL of a new, empty database on the session's PostgreSQL server."""
    return new_database(postgres_server)
