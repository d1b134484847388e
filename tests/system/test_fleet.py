"""The inference fleet on the real engine: N pinned vLLM servers behind vllm-router, a replica killed mid-batch
costs nothing, Ctrl-C leaves no process, and `make serve` runs API batches on its warm fleet."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.defs.runner import run_batch
from batch_dagster.storage import LocalStorage
from tests.helpers import (
    CHAT_MODEL,
    REPO,
    Serve,
    chat_request,
    free_port,
    make_defs,
    read_jsonl,
    real_vllm,
    serve_env,
    wait_http,
    write_jsonl,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def _fleet_processes(pid: int) -> dict[str, list[psutil.Process]]:
    """The replicas (by their port) and the router among a fleet's descendants."""
    found: dict[str, list[psutil.Process]] = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            args = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--port" in args and "vllm.entrypoints.openai.api_server" in " ".join(args):
            found.setdefault(args[args.index("--port") + 1], []).append(p)
    return found


def test_a_replica_killed_mid_batch_costs_nothing_and_ctrl_c_leaves_no_process(tmp_path, data_dir, instance):
    port = free_port()
    env = serve_env(tmp_path)
    log = open(tmp_path / "fleet.log", "w")
    fleet = subprocess.Popen([sys.executable, "-m", "batch_dagster.cli", "fleet", CHAT_MODEL, "--replicas", "2",
                              "--port", str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
                             text=True, start_new_session=True)
    try:
        url = fleet.stdout.readline().strip()  # printed once every replica and the router are healthy
        assert url == f"http://127.0.0.1:{port}/v1", (tmp_path / "fleet.log").read_text()[-3000:]
        replicas = _fleet_processes(fleet.pid)
        assert len(replicas) == 2
        # Each replica (its API server and engine core) is pinned to a core of its own.
        cores = [{c for p in procs for c in p.cpu_affinity()} for procs in replicas.values()]
        assert all(len(c) == 1 for c in cores) and cores[0] != cores[1]

        rows = [chat_request(f"r{i:02d}", f"Say something about the number {i}.", max_tokens=48, temperature=0)
                for i in range(60)]
        vllm = real_vllm(mode="server", server_urls=[url.removesuffix("/v1")], max_concurrency=8)
        victim = replicas[min(replicas)]

        def kill_one_replica_mid_batch() -> None:
            # The first request finished: the progress document counts it (it is written from the step's start).
            while not any(json.loads(p.read_bytes() or b"{}").get("done")
                          for p in (data_dir / "batches").glob("*/results/progress.json")):
                time.sleep(0.2)
            time.sleep(2)
            for p in victim:
                p.kill()

        killer = threading.Thread(target=kill_one_replica_mid_batch, daemon=True)
        killer.start()
        summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                            defs=make_defs(data_dir, vllm, shard_size=60), instance=instance).to_dict()
        killer.join(5)
        assert not any(p.is_running() for p in victim)  # the replica really died mid-batch
        assert summary["status"] == "completed"
        assert summary["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
        out = read_jsonl(tmp_path / "out" / "output.jsonl")
        assert sorted(line["custom_id"] for line in out) == [r["custom_id"] for r in rows]  # each once
        assert read_jsonl(tmp_path / "out" / "errors.jsonl") == []
        record = make_defs(data_dir, vllm).resources["storage"].folder(summary["batch_id"]).summary().record
        assert record["engine_mode"] == "server" and record["servers"] == [url.removesuffix("/v1")]
        assert record["vllm_version"].startswith("vllm==")
    finally:
        descendants = psutil.Process(fleet.pid).children(recursive=True)
        fleet.send_signal(signal.SIGINT)
        fleet.wait(60)
        log.close()
    time.sleep(1)
    assert [p.pid for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def _router(pid: int) -> psutil.Process | None:
    for p in psutil.Process(pid).children(recursive=True):
        try:
            # vllm-router names its process (setproctitle) "vllm::router".
            if "vllm::router" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def test_serve_with_defaults_runs_api_batches_on_the_warm_fleet_and_restarts_a_router_that_exits(tmp_path):
    # The fleet's ports are serve's default: a free block chosen at start, not a fixed 8200.
    with Serve(tmp_path, BATCH_FLEET_REPLICAS="1") as serve:
        wait_http(f"http://127.0.0.1:{serve.api_port}/health", 30)
        deadline = time.time() + 300
        while "warm fleet:" not in serve.logs(20000) and time.time() < deadline:  # the daemon starts after it
            time.sleep(1)
        rows = [chat_request(f"q{i}", "What is the capital of France?", max_tokens=16, temperature=0)
                for i in range(3)]
        batch = serve.create_batch(rows)
        done = serve.wait_for(batch.id, {"completed", "failed"}, 240)
        assert done.status == "completed" and done.request_counts.completed == 3, serve.logs()
        # It ran on the fleet (server mode through the router), not on an engine in the run's process.
        summary = BatchFolder(LocalStorage(serve.data_dir), batch.id).summary()
        assert summary is not None and summary.record["engine_mode"] == "server"
        assert summary.record["servers"][0].startswith("http://127.0.0.1:")

        # The router killed: serve starts it again on its port, and the API, the daemon and the replica go on.
        router = _router(serve.proc.pid)
        assert router is not None
        router_url = summary.record["servers"][0]
        router.kill()
        router.wait(10)
        deadline = time.time() + 60
        while not ((new := _router(serve.proc.pid)) and new.pid != router.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert new is not None and new.pid != router.pid, serve.logs()
        wait_http(router_url + "/v1/models", 60)
        assert serve.proc.poll() is None and f"router of {CHAT_MODEL} exited" in serve.logs(20000)
        again = serve.wait_for(serve.create_batch(rows, name="again.jsonl").id, {"completed", "failed"}, 240)
        assert again.status == "completed" and again.request_counts.completed == 3, serve.logs()
        summary = BatchFolder(LocalStorage(serve.data_dir), again.id).summary()
        assert summary is not None and summary.record["servers"] == [router_url]
