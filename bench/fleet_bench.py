"""`make bench-fleet`: the warm fleet's three ratios, each measured side by side in one run on this machine.

1. scaling (bench/fleet_scaling.py): the same chat workload (bench/workload.py, BENCH_FLEET_REQUESTS,
   default 1000) on `batch-dagster fleet` with 1 replica, then 2, driven through the server engine as
   the pipeline drives it; the ratio of output tokens/s (goal: at least 1.5x on 2 cores).
2. fixed overhead: `make bench`'s run_batch and pipeline stages at BENCH_FLEET_OVERHEAD_REQUESTS
   (default 500), through bench/run_bench.py; pipeline wall time against run_batch's (goal: at most 1.02x).
3. small-batch latency (bench/small_batch.py): a 3-request chat batch through the API under
   `python -m batch_dagster.serve` with its warm fleet, batches.create to completed, against run_batch's
   wall time on the same file (goals: at most 20 s and at most 0.5x), with where the time goes, and its fixed cost:
   that time less the engine's own for the same requests sent straight to the warm replica (goal: at most 2 s).

Results go to bench/results/fleet.json (BENCH_FLEET_OUT) after each part; a markdown table is printed.

Environment: BENCH_FLEET_REQUESTS, BENCH_FLEET_OVERHEAD_REQUESTS, BENCH_FLEET_PARTS (comma list of
scaling, overhead, latency; all by default), BENCH_FLEET_REPEATS (small batches and run_batch runs, 3),
BENCH_FLEET_POLICY (the router policy for the scaling part; default the fleet's, BATCH_FLEET_POLICY),
BENCH_FLEET_SCALING_REPLICAS (the fleet sizes of the scaling part, 1,2; its ratio needs both),
BENCH_FLEET_RUN_BATCH (0: the latency part leaves run_batch out), BENCH_MODEL, BENCH_QUIET_WAIT_S (see
bench/run_bench.py), BENCH_KEEP_WORK=1.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench.fleet_report import markdown, summarize
from bench.measure import work_dir
from bench.run_bench import REPO, git_state, machine
from bench.workload import write_workload

PARTS = ("scaling", "overhead", "latency")
SMALL_BATCH_REQUESTS = 3


def overhead(n: int, model: str, out: Path, quiet_wait_s: float) -> dict[str, Any]:
    """`make bench`'s run_batch and pipeline stages at n requests, in a process of their own."""
    env = dict(os.environ)
    env.update({"BENCH_REQUESTS": str(n), "BENCH_MODEL": model, "BENCH_STAGES": "run_batch,pipeline",
                "BENCH_OUT": str(out), "BENCH_QUIET_WAIT_S": str(quiet_wait_s)})
    done = subprocess.run([sys.executable, "-m", "bench.run_bench"], cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bench.run_bench exited with {done.returncode}")
    report = json.loads(out.read_text())
    return {"requests": n, "results_file": str(out.relative_to(REPO) if out.is_relative_to(REPO) else out),
            "pipeline_wall_s": report["pipeline"]["wall_s"], "run_batch_wall_s": report["run_batch"]["wall_s"],
            "pipeline_vs_run_batch_wall": report["ratios"]["pipeline_vs_run_batch_wall"],
            "pipeline_vs_run_batch_tok_s": report["ratios"]["pipeline_vs_run_batch_tok_s"]}


def _write(out: Path, report: dict[str, Any]) -> None:
    report["summary"] = summarize(report)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")


def main() -> None:
    import psutil

    from batch_dagster.defs.resources.from_env import resources_from_env
    from batch_dagster.settings import Settings
    from bench import fleet_scaling, small_batch

    parts = [p.strip() for p in (os.environ.get("BENCH_FLEET_PARTS") or ",".join(PARTS)).split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        sys.exit(f"Unknown BENCH_FLEET_PARTS {sorted(unknown)}; choose from {', '.join(PARTS)}")
    n = int(os.environ.get("BENCH_FLEET_REQUESTS") or 1000)
    n_overhead = int(os.environ.get("BENCH_FLEET_OVERHEAD_REQUESTS") or 500)
    repeats = int(os.environ.get("BENCH_FLEET_REPEATS") or 3)
    sizes = tuple(int(k) for k in (os.environ.get("BENCH_FLEET_SCALING_REPLICAS") or "1,2").split(","))
    model = os.environ.get("BENCH_MODEL") or "smollm2-135m-instruct"
    quiet_wait_s = float(os.environ.get("BENCH_QUIET_WAIT_S") or 600)
    out = Path(os.environ.get("BENCH_FLEET_OUT") or REPO / "bench" / "results" / "fleet.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = Settings.from_env()
    policy = os.environ.get("BENCH_FLEET_POLICY") or settings.fleet_policy
    # Its variables read, as a run reads them.
    vllm = resources_from_env(settings)["vllm"].process_config_and_initialize()
    spec = vllm.spec(model)
    with work_dir("fleet") as work:
        report: dict[str, Any] = {"meta": {
            "model": model, "machine": machine(), "python": platform.python_version(), "git": git_state(),
            "vllm": vllm.model_record(model)["vllm_version"], "engine_settings": spec.engine_settings(),
            "parts": parts, "load_avg_before": [round(x, 2) for x in psutil.getloadavg()],
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }}
        print(f"bench-fleet: {', '.join(parts)}; work dir {work}", file=sys.stderr, flush=True)
        if "scaling" in parts:
            workload = write_workload(work / "scaling.jsonl", n, model)
            report["scaling"] = fleet_scaling.measure(
                workload, work / "scaling", model, replicas=sizes, policy=policy,
                concurrency=settings.vllm_max_concurrency,
                shard_size=settings.shard_size, quiet_wait_s=quiet_wait_s)
            _write(out, report)
        if "overhead" in parts:
            report["overhead"] = overhead(n_overhead, model, out.with_name(out.stem + "-overhead.json"), quiet_wait_s)
            _write(out, report)
        if "latency" in parts:
            small = write_workload(work / "small.jsonl", SMALL_BATCH_REQUESTS, model)
            report["latency"] = small_batch.measure(small, work / "latency", spec, vllm.model_path(spec),
                                                    settings.model_cache_dir, repeats=repeats,
                                                    quiet_wait_s=quiet_wait_s,
                                                    run_batch=os.environ.get("BENCH_FLEET_RUN_BATCH") != "0")
            _write(out, report)
    report["meta"]["load_avg_after"] = [round(x, 2) for x in psutil.getloadavg()]
    _write(out, report)
    print(markdown(report))
    print(f"\nResults: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
