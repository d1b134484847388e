"""`make bench-eta`: how far a batch's estimated_completion_at is from its real end, on a queue of batches.

`python -m batch_dagster.serve --no-ui` with its defaults (a warm fleet of the default chat model) in a fresh
DAGSTER_HOME and data folder (bench/small_batch.py's serve). First BENCH_ETA_WARMUP batches (default 2) run one
after the other, so the model has completed batches to measure its rate on; then BENCH_ETA_BATCHES batches
(default 5) of BENCH_ETA_REQUESTS requests each (default 30; bench/workload.py's mixed workload, a different
seed each) are submitted at once, and every batch is retrieved with the openai SDK every POLL_S until all ended.

Each batch's ETA is taken at three moments: queued (its first sample with a queue_position of 1 or more),
validated (its first `in_progress` sample) and mid-run (its first sample with half of its requests done). The
error of an ETA is |estimated_completion_at - completed_at| over the batch's whole time (completed_at -
created_at): 0.25 means off by a quarter of what the user waited. (Over the time left at the sample it would
blow up near the end, where progress comes a shard at a time and completed_at in whole seconds.) The median and
the worst per moment go to bench/results/eta.json (BENCH_ETA_OUT) and a markdown table is printed
(docs/performance.md, "Queue ETA").

Environment: BENCH_ETA_BATCHES, BENCH_ETA_REQUESTS, BENCH_ETA_WARMUP, BENCH_MODEL, BENCH_QUIET_WAIT_S (see
bench/run_bench.py), BENCH_KEEP_WORK=1.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

import orjson

from bench.run_bench import REPO, git_state, machine
from bench.workload import write_workload

POLL_S = 1.0
MOMENTS = ("queued", "validated", "mid_run")
ENDED = ("completed", "failed", "expired", "cancelled")


def moment_of(sample: dict[str, Any]) -> str | None:
    """Which moment a sample of a batch is (the first of each counts), or None."""
    if sample["status"] == "validating" and (sample["queue_position"] or 0) >= 1:
        return "queued"
    if sample["status"] == "in_progress":
        total, done = sample["total"], sample["done"]
        return "mid_run" if total and done * 2 >= total else "validated"
    return None


def errors_of(samples: list[dict[str, Any]], created_at: float, completed_at: float) -> dict[str, float]:
    """The relative error of the first ETA of each moment in one batch's samples (in time order)."""
    found: dict[str, float] = {}
    whole = max(completed_at - created_at, 1)
    for s in samples:
        moment = moment_of(s)
        if moment is not None and moment not in found and s["eta"] is not None:
            found[moment] = round(abs(s["eta"] - completed_at) / whole, 3)
    return found


def summarize(errors: list[dict[str, float]]) -> dict[str, dict[str, float | int | None]]:
    """Per moment: how many batches were seen at it, the median and the worst relative error."""
    out: dict[str, dict[str, float | int | None]] = {}
    for moment in MOMENTS:
        values = [e[moment] for e in errors if moment in e]
        out[moment] = {"batches": len(values), "median": round(median(values), 3) if values else None,
                       "worst": max(values) if values else None}
    return out


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"Queue of {meta['batches']} batches x {meta['requests']} requests ({meta['model']}, after "
             f"{meta['warmup']} warm-up batches):", "", "| ETA taken | batches | median error | worst error |",
             "|---|---|---|---|"]
    for moment, row in report["summary"].items():
        shown = ("-" if row[k] is None else f"{100 * row[k]:.0f}%" for k in ("median", "worst"))
        lines.append(f"| {moment.replace('_', '-')} | {row['batches']} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def submit(client: Any, path: Path, window: str = "24h") -> str:
    """The file uploaded and a chat batch created of it; its id."""
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window=window).id


def _sample(batch: Any) -> dict[str, Any]:
    extra = batch.model_extra or {}
    counts = batch.request_counts
    return {"at": time.time(), "status": batch.status, "queue_position": extra.get("queue_position"),
            "eta": extra.get("estimated_completion_at"), "meets_deadline": extra.get("meets_deadline"),
            "deadline_at_risk_at": extra.get("deadline_at_risk_at"), "total": counts.total if counts else 0,
            "done": counts.completed + counts.failed if counts else 0}


def follow(client: Any, ids: list[str], timeout_s: float,
           until: Callable[[dict[str, list[dict[str, Any]]]], bool] | None = None) -> dict[str, Any]:
    """Sample each batch every POLL_S until all ended (or `until` holds of the samples so far): each batch's samples
    and, once ended, its end (`ended`)."""
    samples: dict[str, list[dict[str, Any]]] = {b: [] for b in ids}
    ended: dict[str, Any] = {}
    deadline = time.time() + timeout_s
    while len(ended) < len(ids) and not (until and until(samples)):
        if time.time() > deadline:
            raise TimeoutError(f"{len(ids) - len(ended)} batch(es) not ended after {timeout_s:.0f} s")
        for b in ids:
            if b in ended:
                continue
            batch = client.batches.retrieve(b)
            samples[b].append(_sample(batch))
            if batch.status in ENDED:
                ended[b] = batch
        time.sleep(POLL_S)
    return {"samples": samples, "ended": ended}


def ends(followed: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ended batch's status, creation and end, with its samples."""
    return [{"batch_id": b, "status": e.status, "created_at": e.created_at, "completed_at": e.completed_at,
             "expires_at": e.expires_at, "samples": followed["samples"][b]} for b, e in followed["ended"].items()]


def run_queue(client: Any, files: list[Path], timeout_s: float) -> list[dict[str, Any]]:
    """Submit every file as a batch at once and sample each until all ended: each batch's samples and end."""
    return ends(follow(client, [submit(client, f) for f in files], timeout_s))


def main() -> None:
    from openai import OpenAI

    from batch_dagster.settings import Settings
    from bench.measure import wait_for_quiet, work_dir
    from bench.small_batch import KEY, serve

    batches = int(os.environ.get("BENCH_ETA_BATCHES") or 5)
    n = int(os.environ.get("BENCH_ETA_REQUESTS") or 30)
    warmup = int(os.environ.get("BENCH_ETA_WARMUP") or 2)
    model = os.environ.get("BENCH_MODEL") or "smollm2-135m-instruct"
    quiet_wait_s = float(os.environ.get("BENCH_QUIET_WAIT_S") or 600)
    out = Path(os.environ.get("BENCH_ETA_OUT") or REPO / "bench" / "results" / "eta.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with work_dir("eta") as work:
        files = [write_workload(work / f"queue-{i}.jsonl", n, model, seed=100 + i) for i in range(batches)]
        warm = [write_workload(work / f"warm-{i}.jsonl", n, model, seed=200 + i) for i in range(warmup)]
        report: dict[str, Any] = {"meta": {
            "model": model, "batches": batches, "requests": n, "warmup": warmup, "machine": machine(),
            "python": platform.python_version(), "git": git_state(), "poll_s": POLL_S,
            "started_at": datetime.now(UTC).isoformat(timespec="seconds")}}
        wait_for_quiet(quiet_wait_s)
        serve_dir = work / "serve"
        serve_dir.mkdir()
        with serve(serve_dir, Settings.from_env().model_cache_dir) as (url, _home, log_path):
            client = OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            for i, f in enumerate(warm):
                print(f"bench-eta: warm-up batch {i + 1}/{warmup} ...", file=sys.stderr, flush=True)
                run_queue(client, [f], timeout_s=1800)
            print(f"bench-eta: a queue of {batches} batches x {n} requests ...", file=sys.stderr, flush=True)
            queue = run_queue(client, files, timeout_s=3600)
        if bad := [b["batch_id"] for b in queue if b["status"] != "completed"]:
            raise RuntimeError(f"batches did not complete: {bad}; serve's log {log_path}")
        for b in queue:
            b["errors"] = errors_of(b["samples"], b["created_at"], b["completed_at"])
        report["batches"] = queue
        report["summary"] = summarize([b["errors"] for b in queue])
        out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        print(markdown(report))


if __name__ == "__main__":
    main()
