"""The benchmark harness runs end to end at a tiny size, so it cannot rot (speed lives in the benchmark).

The two on the engine are marked `bench`: `make test-bench` runs them, `make test` does not (they start seven
engines between them, 13 minutes on a 2-core AVX2 machine, to test the benchmark scripts, not the product). Its
workload generator is tested in tests/core/test_bench_workload.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.run_bench import METRICS, STAGES
from tests.helpers import REPO


def _run(module: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


def test_cpu_bench_tiny(tmp_path):
    out = tmp_path / "cpu.json"
    done = _run("bench.cpu_bench", {"BENCH_CPU_SIZES": "0.2,0.4", "BENCH_CPU_OUT": str(out)}, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [s["lines"] for s in report["sizes"]] == [50, 100]
    for size in report["sizes"]:
        for stage in ("validate", "requests", "shard", "commit", "merge"):
            r = size["stages"][stage]
            assert r["seconds"] >= 0 and r["mb_s"] > 0 and r["peak_rss_mb"] > 0
    assert set(report["rss_growth_mb"]) == {"validate", "requests", "shard", "commit", "merge"}
    assert "| validate |" in done.stdout


@pytest.mark.engine
@pytest.mark.bench
@pytest.mark.timeout(900)
def test_bench_three_stages_tiny(tmp_path):
    out = tmp_path / "latest.json"
    env = {"BENCH_REQUESTS": "8", "BENCH_OUT": str(out), "BENCH_QUIET_WAIT_S": "0"}
    done = _run("bench.run_bench", env, 900)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(out.read_text())
    for stage in STAGES:
        r = report[stage]
        assert set(METRICS) <= set(r)
        assert r["requests_completed"] == 8 and r["output_tokens"] > 0
        assert 0 < r["engine_start_s"] < r["wall_s"] and 0 < r["inference_s"] < r["wall_s"]
        assert r["peak_rss_mb"] > 500  # the engine's processes are in the tree
    assert report["ratios"]["pipeline_vs_run_batch_wall"] > 0
    assert report["ratios"]["pipeline_vs_raw_engine_tok_s"] > 0
    assert "| pipeline |" in done.stdout
    # Every stage's answers are compared with run_batch's, custom_id by custom_id.
    answers = report["answers"]
    assert answers["reference"] == "run_batch"
    for stage in ("raw_engine", "pipeline"):
        assert answers[stage]["compared"] == 8 and 0 <= answers[stage]["identical"] <= 8
    assert "Answers identical to run_batch's: raw_engine " in done.stdout


@pytest.mark.engine
@pytest.mark.bench
@pytest.mark.timeout(1500)
def test_bench_fleet_tiny(tmp_path):
    from bench.fleet_report import PHASES

    # The overhead part is `make bench`'s run_batch and pipeline stages (bench.run_bench), which
    # test_bench_three_stages_tiny runs: here the fleet's own two parts, each of which starts engines of its own,
    # the scaling part on one fleet, of two replicas (the ratio to one replica is the benchmark's to measure).
    out = tmp_path / "fleet.json"
    env = {"BENCH_FLEET_REQUESTS": "8", "BENCH_FLEET_PARTS": "scaling,latency", "BENCH_FLEET_REPEATS": "1",
           "BENCH_FLEET_SCALING_REPLICAS": "2", "BENCH_FLEET_OUT": str(out), "BENCH_QUIET_WAIT_S": "0"}
    done = _run("bench.fleet_bench", env, 1500)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(out.read_text())
    runs = {r["replicas"]: r for r in report["scaling"]["runs"]}
    assert set(runs) == {2}
    for n, r in runs.items():
        assert r["requests_completed"] == 8 and r["output_tokens"] > 0 and len(r["per_replica"]) == n
        assert sum(p["requests"] for p in r["per_replica"]) == 8  # every request reached a replica, once
    assert "overhead" not in report
    latency = report["latency"]
    [batch] = latency["api"]
    assert abs(sum(batch["phases_s"].values()) - batch["total_s"]) < 0.01
    assert batch["phases_s"]["inference"] > 0 and batch["phases_s"]["run launch"] > 0
    assert list(latency["phases_median_s"]) == list(PHASES) and latency["run_batch_median_s"] > 0
    assert report["summary"]["scaling_met"] is None  # no ratio without the one-replica run
    assert "latency_met" in report["summary"] and "overhead_met" not in report["summary"]
    assert "| small batch phase |" in done.stdout
