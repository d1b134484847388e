"""Fixtures for every tier, and the tier markers.

The suite is in tiers, one folder each, marked by folder here so that no test repeats it:

- core/      pure functions (the batch-file core, the CLI's validate, the benchmark workload): no Dagster,
             no vLLM, no server, seconds. Its tests build their own files and import nothing from
             tests/helpers.py (which loads Dagster); tests/core/test_tiers.py checks this.
- pipeline/  the Dagster pipeline in-process, on the fake engine; the engine's logic on a stubbed vLLM
- api/       the features (batch_dagster/features/), the store, the HTTP API and the sensors in-process, on the fake
             engine
- system/    the real vLLM engine, the real Dagster daemon, `serve`, CLI runs on the real engine, the benchmarks

`pytest -m "not system"` (`make test-fast`) runs the first three. Helpers live in tests/helpers.py; conftest
files hold fixtures only, and nothing imports from them. This file imports no framework at module level, so
that the core tier loads none.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The daily report's partitions start where the tests' days are, not at the first batch of whatever store the
# environment names (batch_dagster/defs/partitions.py reads it when the definitions load).
os.environ.setdefault("BATCH_REPORT_START", "2026-01-01")
# A step retried after an engine crash waits this long (2 s, doubling, by default): the tests check what happens,
# not the wait (the processes they start inherit it).
os.environ.setdefault("BATCH_STEP_RETRY_DELAY_S", "0.05")
TIERS = ("core", "pipeline", "api", "system")


def _scratch_settings() -> None:
    """The checkout's own data/ and .dagster_home/ (make exports them, for the demo and `make serve`) are never the
    tests': a test that reads the settings without folders of its own gets this process's, empty (tests/api/
    test_serve.py once created the store data/batch-api.db in the checkout). The prepared models stay shared."""
    from batch_dagster.settings import Settings

    os.environ["BATCH_MODEL_CACHE"] = str(Settings.from_env().model_cache_dir)
    scratch = Path(tempfile.mkdtemp(prefix="batch-tests-"))
    atexit.register(shutil.rmtree, scratch, True)
    os.environ["BATCH_DATA_DIR"] = str(scratch / "data")
    os.environ["DAGSTER_HOME"] = str(scratch / "dagster_home")


_scratch_settings()

# A job started in the background (`make test &`, nohup, some CI runners) inherits SIGINT ignored. Dagster maps
# SIGTERM to SIGINT's handler when it runs a job (setup_interrupt_handlers), so SIGTERM becomes ignored too, and
# the compute-log `tail` processes it starts per step inherit that: each step then waits 30 s for them to stop.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


RAM_TMP = Path("/dev/shm")


def pytest_configure(config):
    """A run of the fast tiers alone keeps its temporary files in RAM (/dev/shm, when it is there with room).

    Their time went mostly to SQLite's and the folders' fsyncs, not to work: every in-process run writes a Dagster
    instance (a database per run) and a store under tmp_path. What they assert does not depend on the disk. The
    system tier keeps the disk (a vLLM engine uses /dev/shm itself), and a TMPDIR of one's own is left alone.
    """
    system = TESTS / "system"
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    if any(system.is_relative_to(p) or p.is_relative_to(system) for p in paths) or os.environ.get("TMPDIR"):
        return
    if not (RAM_TMP.is_dir() and os.access(RAM_TMP, os.W_OK) and shutil.disk_usage(RAM_TMP).free > 2 << 30):
        return
    os.environ["TMPDIR"] = str(RAM_TMP)  # the processes tests start, and Dagster's instance_for_test
    tempfile.tempdir = str(RAM_TMP)  # tmp_path, read when first used (after this hook)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        tier = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in a tier folder, tests/{{{','.join(TIERS)}}}/")
        if item.get_closest_marker("engine") and tier != "system":
            raise pytest.UsageError(f"{item.nodeid}: a test on the real engine belongs in tests/system/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "data"
    monkeypatch.setenv("BATCH_DATA_DIR", str(d))
    return d


@pytest.fixture
def instance():
    from tests.helpers import dagster_instance

    with dagster_instance() as inst:
        yield inst


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a loopback port, found by boto3 through AWS_ENDPOINT_URL like any S3-compatible store."""
    from tests.helpers import free_port, wait_http

    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 30, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """An empty bucket (tests.helpers.BUCKET) on the S3 server, with the environment pointing boto3 at it."""
    import boto3

    from tests.helpers import BUCKET

    for name, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=o["Key"])
    client.delete_bucket(Bucket=BUCKET)


@pytest.fixture
def empty_env(monkeypatch):
    """The settings of an empty environment, read in the repository (where the docs' relative paths start)."""
    from batch_dagster import settings

    for variable in settings.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    monkeypatch.chdir(TESTS.parent)
    return settings.Settings.from_env()
