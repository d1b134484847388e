"""The service as an operator runs it, on real parts: `serve` with a warm fleet for the embeddings model (its
vllm-router's exporter on the fleet's own port) and a real Prometheus (Debian's `prometheus`) scraping what serve
writes to its file_sd targets. Batches run on the fleet, in-process (the chat model has no fleet), and on the fleet
again after it slept when idle; then every expression of the Grafana dashboard and of the KEDA autoscaler returns
data through Prometheus' query API, scraped from the API's metrics listener (the operator's, not the API's port).
serve is restarted while Prometheus scrapes: the API's target is down meanwhile, and the store's counters go on from
where they were (no reset)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from batch_dagster.db.models import BatchRecord, FleetRecord
from tests.core.test_deploy_monitoring import dashboard_expressions, keda_queries
from tests.helpers import (
    EMBED_MODEL,
    Serve,
    chat_request,
    free_port,
    wait_http,
    write_jsonl,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
PROMETHEUS = Path("/usr/bin/prometheus")
SECRET = "whsec_" + base64.b64encode(b"a metrics test secret, 32 bytes").decode()
IDLE_S = 15


class Prometheus:
    """A Prometheus server on loopback scraping the targets serve writes (file_sd), every second."""

    def __init__(self, tmp_path: Path, targets: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                          "  - job_name: batch-dagster\n    file_sd_configs:\n"
                          f"      - files: [{targets}]\n        refresh_interval: 1s\n")
        self.log = open(tmp_path / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_http(f"{self.url}/-/ready", 60, self.proc)

    def query_range(self, expr: str, start: float) -> list[dict]:
        answer = httpx.get(f"{self.url}/api/v1/query_range", timeout=30,
                           params={"query": expr, "start": start, "end": time.time(), "step": "2s"}).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def value(self, expr: str) -> float | None:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30).json()
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def submit(serve: Serve, rows: list[dict], endpoint: str, name: str) -> str:
    client = serve.client()
    with open(write_jsonl(serve.tmp_path / name, rows), "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h").id


def embeddings(prefix: str, n: int = 3) -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": EMBED_MODEL, "input": f"sentence number {i}"}} for i in range(n)]


def fleet_state(serve: Serve) -> str | None:
    with serve.store() as session:
        row = session.get(FleetRecord, EMBED_MODEL)
        return None if row is None else row.state


def replicas(serve: Serve) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(serve.proc.pid).children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


@pytest.mark.skipif(not PROMETHEUS.exists(), reason="Prometheus is absent (Debian's `prometheus`: "
                    "apt-get install -y prometheus, as .ci/run does)")
def test_prometheus_sees_every_dashboard_expression_and_a_restart_resets_no_counter(tmp_path):
    started = time.time()
    dead_port = free_port()  # nothing listens there: every webhook attempt fails
    env = {"BATCH_FLEET_REPLICAS": "1", "BATCH_FLEET_MODELS": EMBED_MODEL, "BATCH_FLEET_IDLE_S": str(IDLE_S),
           "BATCH_WEBHOOK_URLS": f"http://127.0.0.1:{dead_port}/hook", "BATCH_WEBHOOK_SECRET": SECRET}
    prometheus = None
    try:
        with Serve(tmp_path, **env) as serve:
            wait_until(lambda: "warm fleet:" in serve.logs(40000), 300, "the warm fleet")
            prometheus = Prometheus(tmp_path, serve.data_dir / "prometheus" / "targets.json")
            first = submit(serve, embeddings("e"), "/v1/embeddings", "e1.jsonl")
            done = serve.wait_for(first, {"completed", "failed"}, 240)
            assert done.status == "completed" and done.request_counts.completed == 3, serve.logs()

            # Idle for IDLE_S: the fleet's replica stops and gives its memory back; the router stays.
            wait_until(lambda: fleet_state(serve) == "asleep", 120, "the idle fleet to sleep")
            wait_until(lambda: not replicas(serve), 60, "the replica to exit")
            # A chat batch runs in its run's process (no fleet for the chat model), the fleet asleep meanwhile.
            chat = submit(serve, [chat_request(f"c{i}", "Name a colour.", max_tokens=8, temperature=0)
                                  for i in range(3)], "/v1/chat/completions", "c.jsonl")
            done = serve.wait_for(chat, {"completed", "failed"}, 400)
            assert done.status == "completed", serve.logs()
            # The next embeddings batch wakes the fleet.
            second = submit(serve, embeddings("f"), "/v1/embeddings", "e2.jsonl")
            done = serve.wait_for(second, {"completed", "failed"}, 300)
            assert done.status == "completed" and done.request_counts.completed == 3, serve.logs()
            assert fleet_state(serve) == "warm" and replicas(serve)
            assert "its fleet sleeps until the next one" in serve.logs(200000)

            time.sleep(8)  # a few more scrapes of every target
            missing = []
            for expr in dashboard_expressions() + [re.sub(r'model="[^"]+"', f'model="{EMBED_MODEL}"', q)
                                                   for q in keda_queries()]:
                if not prometheus.query_range(expr, started):
                    missing.append(expr)
            assert missing == [], f"no data for {missing}"
            total = "sum(max without (instance, pod) (batch_dagster_requests_total))"
            before = prometheus.value(total)
            assert before == 9  # 3 + 3 + 3 requests, each finished once
            # Scraped on the metrics' own loopback listener; the API's own (the tenants') serves none.
            assert httpx.get(f"http://127.0.0.1:{serve.api_port}/metrics", timeout=5).status_code == 404
            api_port, metrics_port = serve.api_port, serve.metrics_port

        # serve is down: Prometheus still scrapes the API's address and records it down.
        wait_until(lambda: prometheus.value('up{component="api"}') == 0, 30, "the API to be seen down")
        again = Serve(tmp_path, BATCH_FLEET_REPLICAS="0")
        again.api_port, again.metrics_port = api_port, metrics_port
        with again:
            wait_until(lambda: prometheus.value('up{component="api"}') == 1, 60, "the API to be seen up")
            time.sleep(3)
            # Read from the store, not counted in the process: the restart resets nothing.
            assert prometheus.value(total) == before
            assert prometheus.value('batch_dagster_store_up') == 1
    finally:
        if prometheus is not None:
            prometheus.stop()
    shutil.rmtree(tmp_path / "tsdb", ignore_errors=True)
    with serve.store() as session:  # each ended batch has the first end it was given, for the ETA's error
        assert all(b.first_estimated_completion_at for b in session.query(BatchRecord))
