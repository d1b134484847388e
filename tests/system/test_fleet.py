"""The inference fleet on the real engine: N pinned vLLM servers behind vllm-router, a replica hung or killed
mid-batch costs nothing, Ctrl-C leaves no process, and `make serve` runs API batches on its warm fleet."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import psutil
import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.defs.runner import run_batch
from batch_dagster.serve.fleet import block_size, free_port_block
from batch_dagster.storage import LocalStorage
from tests.helpers import (
    CHAT_MODEL,
    REPO,
    Serve,
    chat_request,
    make_defs,
    read_jsonl,
    real_vllm,
    serve_env,
    wait_http,
    wait_until,
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


def _each(processes: list[psutil.Process], signal_it) -> None:
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived helper process of the server
            signal_it(p)


def _first_answer(data_dir, besides: str = "") -> None:
    """Return 2 s after a batch (not `besides`) has its first request finished: its progress document counts it
    (it is written from the step's start)."""
    while not any(json.loads(p.read_bytes() or b"{}").get("done")
                  for p in (data_dir / "batches").glob("*/results/progress.json") if p.parent.parent.name != besides):
        time.sleep(0.2)
    time.sleep(2)


def test_a_replica_hung_or_killed_mid_batch_costs_nothing_and_ctrl_c_leaves_no_process(tmp_path, data_dir, instance):
    # A free block of ports, not one free port: the ports after one may be another process's (a replica then exited
    # as it started).
    port = free_port_block(block_size(2), "127.0.0.1")
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

        vllm = real_vllm(mode="server", server_urls=[url.removesuffix("/v1")], max_concurrency=8)
        defs = make_defs(data_dir, vllm, shard_size=60)

        # One replica hung (SIGSTOP), not dead: once its health probes go unanswered its requests go to the other
        # (engine/health.py), and the batch ends while it is still stopped (else they wait the 600 s timeout).
        rows = [chat_request(f"h{i:02d}", f"Name a colour and the number {i}.", max_tokens=24, temperature=0)
                for i in range(24)]
        hung = replicas[max(replicas)]
        stopped = [p for api in hung for p in (api, *api.children(recursive=True))]  # its engine core too
        ended = threading.Event()

        def stop_one_replica_mid_batch() -> None:
            _first_answer(data_dir)
            _each(stopped, psutil.Process.suspend)
            ended.wait(300)  # the batch's end (or, where requests wait for a hung server, well before its 600 s)
            _each(stopped, psutil.Process.resume)

        stopper = threading.Thread(target=stop_one_replica_mid_batch, daemon=True)
        stopper.start()
        summary = run_batch(write_jsonl(tmp_path / "hung.jsonl", rows), tmp_path / "hung", show_progress=False,
                            defs=defs, instance=instance).to_dict()
        still_stopped = [p.status() for p in hung]
        ended.set()
        stopper.join(10)
        assert still_stopped == [psutil.STATUS_STOPPED] * len(hung)
        assert summary["request_counts"] == {"total": 24, "completed": 24, "failed": 0}, summary
        out = read_jsonl(tmp_path / "hung" / "output.jsonl")
        assert sorted(line["custom_id"] for line in out) == [r["custom_id"] for r in rows]  # each once
        assert all(line["response"]["body"]["choices"][0]["message"]["content"].strip() for line in out)
        wait_until(lambda: all(w["is_healthy"] for w in
                               httpx.get(url.removesuffix("/v1") + "/workers").json()["workers"]), 120,
                   what="the resumed replica never became healthy again")

        rows = [chat_request(f"r{i:02d}", f"Say something about the number {i}.", max_tokens=48, temperature=0)
                for i in range(60)]
        victim = replicas[min(replicas)]

        def kill_one_replica_mid_batch() -> None:
            _first_answer(data_dir, besides=summary["batch_id"])
            for p in victim:
                p.kill()

        killer = threading.Thread(target=kill_one_replica_mid_batch, daemon=True)
        killer.start()
        summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                            defs=defs, instance=instance).to_dict()
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


# An environment variable every process a fleet starts inherits: how the test finds its processes in the machine's
# process table whoever their parent is by then (with their process groups, for those whose title vLLM and the router
# set, which clears what /proc shows of their environment).
FLEET_MARK = "BATCH_TEST_FLEET_MARK"


def _marked(mark: str, groups: set[int] = frozenset()) -> list[psutil.Process]:
    """Every live process on the machine whose environment carries `mark` or that is in one of `groups`."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if p.status() != psutil.STATUS_ZOMBIE and (os.getpgid(p.pid) in groups or
                                                       p.environ().get(FLEET_MARK) == mark):
                found.append(p)
    return found


def test_a_fleet_killed_with_its_process_group_leaves_no_server_router_or_engine(tmp_path):
    port = free_port_block(block_size(1), "127.0.0.1")
    mark = uuid.uuid4().hex
    log = open(tmp_path / "fleet.log", "w")
    fleet = subprocess.Popen([sys.executable, "-m", "batch_dagster.cli", "fleet", CHAT_MODEL, "--replicas", "1",
                              "--port", str(port)], cwd=REPO, env=serve_env(tmp_path) | {FLEET_MARK: mark},
                             stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    groups: set[int] = set()
    try:
        url = fleet.stdout.readline().strip()  # printed once the replica and the router are healthy
        assert url == f"http://127.0.0.1:{port}/v1", (tmp_path / "fleet.log").read_text()[-3000:]
        family = psutil.Process(fleet.pid).children(recursive=True)
        groups = {os.getpgid(p.pid) for p in family} - {os.getpgid(0)}
        names = [" ".join(p.cmdline()) for p in family]
        # What a kill of the group used to leave: the server, its engine core and its worker, and the router.
        assert any("vllm.entrypoints.openai.api_server" in n and f"--port {port + 1}" in n for n in names), names
        assert any(n.startswith("VLLM::EngineCore") for n in names), names
        assert any(n.startswith("vllm::router") for n in names), names
        assert {p.pid for p in _marked(mark, groups)} >= {fleet.pid, *(p.pid for p in family)}

        os.killpg(fleet.pid, signal.SIGKILL)  # kill -KILL -- -<the fleet's process group>: no handler of it runs
        fleet.wait(10)
        psutil.wait_procs(family, timeout=30)
        left = _marked(mark, groups)
        assert left == [], [(p.pid, p.cmdline()) for p in left]
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.removesuffix("/v1") + "/health", timeout=2)
    finally:
        for p in _marked(mark, groups):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        log.close()


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
