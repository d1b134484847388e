"""Past one machine, on real parts: the API, the Dagster daemon and the run worker as three hosts.

Each host is a process group with its own environment and its own, empty local folders (BATCH_DATA_DIR,
DAGSTER_HOME, TMPDIR). They share only what hosts of a cluster share: the Dagster instance and the API's store on
a real PostgreSQL 15, the batch folders and uploaded files on S3 (moto on loopback), and a vLLM server (server
mode). The run worker host is a Dagster code server: the default run launcher starts each run there, as a process
of its own, which the test kills with SIGKILL mid-inference.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import boto3
import dagster as dg
import httpx
import psutil
import pytest

from batch_dagster.defs.dagster_internals import run_end_reason
from tests.helpers import (
    MODEL_CACHE,
    batch_runs,
    chat_request,
    file_lines,
    free_port,
    materialization_metadata,
    new_database,
    wait_http,
    write_jsonl,
)

pytestmark = pytest.mark.engine

SHARDS, SHARD_SIZE = 6, 4
API_KEY = "sk-two-hosts"
BUCKET, PREFIX = "batch-store", "team-a"
SCRIPTS = Path(sys.executable).parent
# What a host keeps that is configuration, not data: the instance's dagster.yaml and the daemon's workspace.
CONFIG_FILES = {"dagster_home/dagster.yaml", "workspace.yaml"}
SCRATCH = ("data/scratch/", "tmp/")


class Host:
    """One machine: its own folders (data dir, DAGSTER_HOME, TMPDIR) and the environment its processes get."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.data_dir, self.home = root, root / "data", root / "dagster_home"
        for folder in (self.data_dir, self.home, root / "tmp"):
            folder.mkdir(parents=True)
        self.env = env | {"BATCH_DATA_DIR": str(self.data_dir), "DAGSTER_HOME": str(self.home),
                          "TMPDIR": str(root / "tmp")}
        self.procs: list[subprocess.Popen] = []

    def run(self, command: list[str]) -> str:
        return subprocess.run(command, cwd=self.root, env=self.env, capture_output=True, text=True, check=True).stdout

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        """`command` in its own process group, working in the host's folder; its output in `<name>.log` beside."""
        with open(self.root.parent / f"{name}.log", "w") as log:
            proc = subprocess.Popen(command, cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """SIGINT to each process group, as a terminal would; what is left after a grace period is killed."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs.clear()

    def data(self) -> list[str]:
        """Every file the host keeps besides its configuration and its scratch (which a killed process may leave)."""
        files = {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}
        return sorted(f for f in files - CONFIG_FILES if not f.startswith(SCRATCH))


def wait_until(predicate: Callable, timeout_s: float, what: str, logs: Path):
    deadline = time.time() + timeout_s
    while not (value := predicate()):
        if time.time() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))
            raise TimeoutError(f"{what}\n{tails}")
        time.sleep(0.05)
    return value


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"nothing listens on port {port} (exit code {proc.poll()})") from None
            time.sleep(0.5)


def requests_running(vllm_url: str) -> float:
    """Requests the vLLM server is decoding now (its Prometheus gauge)."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


SHARD_OBJECT = re.compile(r"/shard-(\d+)\.(output\.jsonl|errors\.jsonl|json)$")


def committed_objects(s3, batch_id: str) -> dict[str, list[tuple]]:
    """Every version (id, ETag, LastModified) of each object of the batch's committed shards, by key.

    The bucket is versioned, so an object written twice, even with the same bytes, shows two versions.
    """
    prefix = f"{PREFIX}/batches/{batch_id}/results/"
    versions: dict[str, list[tuple]] = {}
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=BUCKET, Prefix=prefix):
        for v in page.get("Versions", []):
            versions.setdefault(v["Key"], []).append((v["VersionId"], v["ETag"], v["LastModified"]))
    committed = {m.group(1) for key in versions if (m := SHARD_OBJECT.search(key)) and m.group(2) == "json"}
    return {key: sorted(found) for key, found in versions.items()
            if (m := SHARD_OBJECT.search(key)) and m.group(1) in committed}


def test_api_daemon_and_run_worker_on_three_hosts_share_only_postgres_and_s3(
        tmp_path, postgres_server, s3_endpoint, vllm_server, monkeypatch):
    from openai import OpenAI

    aws = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                      region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    s3.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    dagster_db, store_db = new_database(postgres_server), new_database(postgres_server)

    # Each host gets what it needs and no more: nothing of the test's own BATCH_/DAGSTER_/AWS_ settings.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("BATCH_", "DAGSTER_", "AWS_"))} | aws | {
        "BATCH_STORAGE_URL": f"s3://{BUCKET}/{PREFIX}"}
    store = {"BATCH_DATABASE_URL": store_db.replace("+psycopg2", "+psycopg")}  # psycopg 3, as documented
    dagster = {"DAGSTER_PG_URL": dagster_db}
    hosts = {
        "api": Host(tmp_path / "api", base | store | {"BATCH_API_KEYS": API_KEY}),
        # The daemon runs no project code: it has the code server evaluate the sensors and start the runs.
        "daemon": Host(tmp_path / "daemon", base | dagster),
        "worker": Host(tmp_path / "worker", base | store | dagster | {
            "BATCH_ENGINE_MODE": "server", "BATCH_VLLM_SERVER_URLS": vllm_server,
            "BATCH_MODEL_CACHE": str(MODEL_CACHE),  # the prepared models, as the host's image would carry them
            "BATCH_SHARD_SIZE": str(SHARD_SIZE)}),
    }
    for name in ("daemon", "worker"):
        written = hosts[name].run([str(SCRIPTS / "batch-dagster"), "instance"])
        assert f"storage=postgres (DAGSTER_PG_URL) compute_logs=s3://{BUCKET}/{PREFIX}/" in written
    # The instance's schema is created once, before the daemon and the code server both open it.
    monkeypatch.setenv("DAGSTER_PG_URL", dagster_db)
    for name, value in aws.items():
        monkeypatch.setenv(name, value)
    with dg.DagsterInstance.from_config(str(hosts["daemon"].home)):
        pass

    api_port, grpc_port = free_port(), free_port()
    (hosts["daemon"].root / "workspace.yaml").write_text(
        f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {grpc_port}\n"
        "      location_name: batch_dagster\n")
    rows = [chat_request(f"q{i:02d}", f"Say the number {i} and name a color.", max_tokens=40, min_tokens=40,
                         temperature=0) for i in range(SHARDS * SHARD_SIZE)]
    with ExitStack() as stack:
        for host in hosts.values():
            stack.callback(host.stop)
        api = hosts["api"].start("api", [sys.executable, "-m", "batch_dagster.api", "--port", str(api_port)])
        wait_http(f"http://127.0.0.1:{api_port}/health", 60, api)
        code_server = hosts["worker"].start("worker", [
            str(SCRIPTS / "dagster"), "api", "grpc", "-m", "batch_dagster.definitions", "-h", "127.0.0.1",
            "-p", str(grpc_port)])
        wait_port(grpc_port, 120, code_server)  # the daemon would log the location unreachable until then
        hosts["daemon"].start("daemon", [str(SCRIPTS / "dagster-daemon"), "run", "-w", "workspace.yaml"])

        client = OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        with open(write_jsonl(tmp_path / "in.jsonl", rows), "rb") as f:
            input_file = client.files.create(file=f, purpose="batch")
        batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")

        # The run worker is the code server's child that has step processes. kill -9 it once a shard is committed
        # and the next one is being decoded.
        def worker_mid_shard() -> psutil.Process | None:
            if not committed_objects(s3, batch.id) or requests_running(vllm_server) <= 0:
                return None
            workers = [p for p in psutil.Process(code_server.pid).children() if p.children()]
            return workers[0] if len(workers) == 1 else None

        worker = wait_until(worker_mid_shard, 300, "no shard committed", tmp_path)
        steps = worker.children(recursive=True)
        worker.kill()
        # The orphaned step process sees its run marked failed by the code server, and dies too.
        _, alive = psutil.wait_procs(steps, timeout=30)
        assert not alive
        before = committed_objects(s3, batch.id)

        deadline = time.time() + 300
        while (done := client.batches.retrieve(batch.id)).status not in {"completed", "failed", "cancelled"}:
            assert time.time() < deadline, f"{batch.id} is still {done.status}"
            time.sleep(0.5)
        with dg.DagsterInstance.from_config(str(hosts["daemon"].home)) as instance:
            runs = batch_runs(instance, batch.id)
            resumed = materialization_metadata(instance, runs[-1].run_id, "shard_results")
            killed = run_end_reason(instance, runs[0])
        after = committed_objects(s3, batch.id)
        logs = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/dagster-compute-logs/")
                .get("Contents", [])]

        # Nothing a host keeps is needed any more: Dagster's hosts stop, and every host's folders go.
        hosts["daemon"].stop()
        hosts["worker"].stop()
        kept = {name: host.data() for name, host in hosts.items()}
        scratch = {name: (host.data_dir / "scratch").is_dir() for name, host in hosts.items()}
        for host in hosts.values():
            shutil.rmtree(host.root)
        out, err = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
        uploaded = client.files.content(input_file.id).text
        again = client.batches.retrieve(batch.id)

    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": len(rows), "completed": len(rows), "failed": 0}
    # Served from S3 by an API whose host keeps nothing: every custom_id exactly once, the upload as it was sent.
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)
    assert sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out) == 40 * len(rows)
    assert uploaded == (tmp_path / "in.jsonl").read_text()
    assert again.model_dump() == done.model_dump()
    # The API (uploads) and the run worker staged files in their own scratch; no host kept anything else.
    assert scratch == {"api": True, "daemon": False, "worker": True}
    assert kept == {"api": [], "daemon": [], "worker": []}
    # The step logs went from the worker host to S3 (the instance `batch-dagster instance` wrote): the retry's
    # whole log. The killed run's log is there only up to its last periodic upload, if it lived that long.
    assert any(f"/{runs[-1].run_id}/" in key for key in logs), logs

    # The kill: the first run's worker died by SIGKILL; Dagster retried the run as a new one, which skipped the
    # shards committed before the kill and never wrote their objects again.
    first, retry = runs
    assert "signal 9" in (killed or ""), killed
    assert first.status == dg.DagsterRunStatus.FAILURE and first.tags["dagster/auto_retry_run_id"] == retry.run_id
    assert retry.status == dg.DagsterRunStatus.SUCCESS and retry.tags["dagster/is_resume_retry"] == "true"
    assert 3 <= len(before) < 3 * SHARDS and all(len(versions) == 1 for versions in before.values())
    assert {key: after[key] for key in before} == before
    assert resumed["shards_skipped"] == len(before) // 3
    assert resumed["shards_run"] == SHARDS - len(before) // 3
