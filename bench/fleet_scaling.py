"""Scaling of the warm fleet: the same chat workload on `batch-dagster fleet` with 1 replica, then with 2.

Each fleet is started as the product starts it (`batch-dagster fleet MODEL --replicas N`: vLLM servers
pinned to a core each, behind vllm-router) and driven as the pipeline drives it in server mode: the
workload is validated and cut into shards by the core, and each shard goes through `ServerEngine` to the
router's URL, at the configured concurrency. Only inference is timed (the fleet is warm when it starts).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from batch_dagster.serve import fleet
from bench.measure import stop_service, tree_sample, wait_for_quiet

URL_LINE = re.compile(r"^(http://\S+)/v1$")
START_TIMEOUT_S = 900


def shards_of(input_path: Path, work: Path, model: str, shard_size: int) -> list[list[tuple[str, dict]]]:
    """The workload's requests as the pipeline's shards, in the order the pipeline sends them."""
    from batch_dagster.batchfile.columnar import read_shard, validate_to_parquet, write_shards

    work.mkdir(parents=True, exist_ok=True)
    requests = work / "requests.parquet"
    report = validate_to_parquet(input_path, requests, models=[model])
    if not report.valid:
        raise RuntimeError(f"the workload is invalid: {report.errors[:3]}")
    sizes = write_shards(requests, work / "shards", shard_size)
    return [read_shard(p) for p in sorted((work / "shards").glob("shard-*.parquet"))][: len(sizes)]


def free_port_block(n: int) -> int:
    """A port p such that p .. p+n-1 are free on loopback now (a fleet's block: fleet.block_size)."""
    return fleet.free_port_block(n, "127.0.0.1")


class _Sampler(threading.Thread):
    """CPU seconds of a process tree's processes, sampled every 0.5 s while it runs, counted from `start`."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.cpu: dict[int, float] = {}
        self.peak: dict[int, tuple[str, int]] = {}
        self.before: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def sample(self) -> None:
        with self.lock:
            tree_sample(self.proc, self.cpu, self.peak)

    def start(self) -> None:
        """From now on (the fleet's own start-up is left out)."""
        self.sample()
        self.before = dict(self.cpu)
        super().start()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()

    def cpu_by_name(self) -> dict[str, float]:
        """CPU seconds since `start`, per kind of process (vLLM's own names, the router, the API server)."""
        names = {pid: name for pid, (name, _) in self.peak.items()}
        out: dict[str, float] = {}
        for pid, cpu in self.cpu.items():
            name = names.get(pid, "?")
            out[name] = round(out.get(name, 0.0) + cpu - self.before.get(pid, 0.0), 1)
        return out


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus counter over its labels (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _replica_counts(ports: list[int]) -> list[dict[str, float]]:
    import httpx

    out: list[dict[str, float]] = []
    for port in ports:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            out.append({})
            continue
        out.append({"requests": _metric(text, "vllm:request_success_total"),
                    "output_tokens": _metric(text, "vllm:generation_tokens_total"),
                    "prefix_cache_hits": _metric(text, "vllm:prefix_cache_hits_total"),
                    "prefix_cache_queries": _metric(text, "vllm:prefix_cache_queries_total")})
    return out


def _start_fleet(model: str, replicas: int, policy: str, work: Path) -> tuple[subprocess.Popen, str, int, float]:
    port = free_port_block(fleet.block_size(replicas))
    cli = Path(sys.executable).with_name("batch-dagster")
    env = dict(os.environ)
    env["BATCH_DATA_DIR"] = str(work / "data")  # the fleet's logs go under the work folder
    started = time.perf_counter()
    proc = subprocess.Popen([str(cli), "fleet", model, "--replicas", str(replicas), "--port", str(port),
                             "--policy", policy], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in proc.stdout:  # the fleet prints its router's URL once every replica answers
        if match := URL_LINE.match(line.strip()):
            return proc, match.group(1), port, time.perf_counter() - started
        if time.monotonic() > deadline:
            break
    _stop(proc)
    raise RuntimeError(f"batch-dagster fleet --replicas {replicas} did not start; logs in {work / 'data'}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a service manager stops the fleet; its process group is killed if anything is left."""
    stop_service(proc, signal.SIGTERM, 60)


def run_one(shards: list[list[tuple[str, dict]]], model: str, replicas: int, policy: str, work: Path,
            concurrency: int) -> dict[str, Any]:
    """Start a fleet of `replicas`, send it every shard through ServerEngine, stop it; what it measured."""
    from batch_dagster.batchfile import contract as c
    from batch_dagster.engine.server import ServerEngine

    proc, url, port, start_s = _start_fleet(model, replicas, policy, work / f"fleet-{replicas}")
    sampler = _Sampler(proc.pid)
    try:
        engine = ServerEngine([url], max_concurrency=concurrency)
        sampler.start()
        cpu_before = _machine_cpu_s()
        t0 = time.perf_counter()
        lines = [line for shard in shards for line in engine.run(c.CHAT, shard)]
        inference_s = time.perf_counter() - t0
        other = _machine_cpu_s() - cpu_before
        sampler.stop.set()
        sampler.join(5)
        sampler.sample()
        per_replica = _replica_counts([port + 1 + i for i in range(replicas)])
    finally:
        sampler.stop.set()
        _stop(proc)
    ok = [line for line in lines if (line.get("response") or {}).get("status_code") == 200]
    tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in ok)
    by_name = sampler.cpu_by_name()
    fleet_cpu = sum(by_name.values())
    return {
        "replicas": replicas,
        "policy": policy,
        "concurrency": concurrency,
        "fleet_start_s": round(start_s, 1),
        "inference_s": round(inference_s, 2),
        "requests_completed": len(ok),
        "requests_failed": len(lines) - len(ok),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / inference_s, 1),
        "fleet_cpu_s": round(fleet_cpu, 1),  # the fleet's processes during inference: at most cores x inference_s
        "cpu_s_by_process": by_name,
        "per_replica": per_replica,
        # CPU the rest of the machine used meanwhile (this process, the router's client side, other work), % of
        # all cores: on a shared machine it says how far the numbers can be trusted.
        "other_cpu_pct": round(100 * max(0.0, other - fleet_cpu) / (inference_s * (os.cpu_count() or 1)), 1),
    }


def _machine_cpu_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0)


def measure(input_path: Path, work: Path, model: str, *, replicas: tuple[int, ...] = (1, 2), policy: str,
            concurrency: int, shard_size: int, quiet_wait_s: float) -> dict[str, Any]:
    """The workload on a fleet of each size in turn, one after the other, on the same machine."""
    shards = shards_of(input_path, work, model, shard_size)
    runs = []
    for n in replicas:
        waited = wait_for_quiet(quiet_wait_s)
        print(f"bench-fleet: scaling, {n} replica(s) ...", file=sys.stderr, flush=True)
        result = run_one(shards, model, n, policy, work, concurrency) | {"quiet_wait_s": waited}
        print(f"bench-fleet: {n} replica(s): {result['output_tok_s']} output tok/s over {result['inference_s']} s",
              file=sys.stderr, flush=True)
        runs.append(result)
    return {"requests": sum(len(s) for s in shards), "shards": len(shards), "runs": runs}
