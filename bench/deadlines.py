"""`make bench-deadlines`: a 1h batch submitted behind a queue of 24h batches finishes first, and the 24h batches
still finish in their window (issue #32).

`python -m batch_dagster.serve --no-ui` with its defaults (a warm fleet of the default chat model) in a fresh
DAGSTER_HOME and data folder (bench/small_batch.py's serve), with one run of the model at a time
(BATCH_RUNS_PER_MODEL=1, so the batches queue) and the windows BENCH_DEADLINES_WINDOWS (default `1h,24h`, their
real lengths). Shortened windows (`1h=600,24h=1800`) make "in its window" a test for the 24h batches, but they also
shrink the deadlines' difference below what the fair queue weighs a key's backlog at (RANK_DEADLINE_S, 600 s a
batch, features/fairness.py): a key's 5th batch, due 1,185 s sooner, then goes after its 2nd and 3rd (measured).
First a warm-up batch, so the model has a measured rate; then BENCH_DEADLINES_QUEUE 24h batches (default 4) of
BENCH_DEADLINES_REQUESTS requests each (default 30; bench/workload.py's mixed workload, a different seed each) are
submitted at once, and once the first of them runs, a 1h batch of the same size. Every batch is retrieved every
POLL_S until all ended.

In first-come order the 1h batch would run last. The bench reports the order the batches finished in, each one's
wait (created to completed) against its window, and whether a 24h batch was flagged at risk of missing its deadline
(`deadline_at_risk_at`, reported as `at_risk`). Results go to bench/results/deadlines.json (BENCH_DEADLINES_OUT)
and a markdown table is printed (docs/performance.md, "Completion windows").

Environment: BENCH_DEADLINES_QUEUE, BENCH_DEADLINES_REQUESTS, BENCH_DEADLINES_WINDOWS, BENCH_MODEL,
BENCH_QUIET_WAIT_S (see bench/run_bench.py), BENCH_KEEP_WORK=1.
"""

from __future__ import annotations

import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench.eta import ends, follow, run_queue, submit
from bench.run_bench import REPO, git_state, machine
from bench.workload import write_workload


def markdown(report: dict[str, Any]) -> str:
    rows = ["| batch | window | submitted | finished | waited s | window s | in its window |", "|---" * 7 + "|"]
    for b in report["batches"]:
        rows.append(f"| {b['name']} | {b['window']} | {b['submitted']} | {b['finished']} | {b['waited_s']} | "
                    f"{b['window_s']} | {'yes' if b['in_window'] else '**no**'} |")
    s = report["summary"]
    return "\n".join(rows) + (
        f"\n\nThe 1h batch, submitted {s['hour_submitted']} of {s['batches']}, finished {s['hour_finished']}; "
        f"every batch in its window: {'yes' if s['all_in_window'] else 'no'}. {report['meta']['machine']}, "
        f"commit {report['meta']['git']}.")


def summarize(followed: list[dict[str, Any]], names: dict[str, tuple[str, str, int]]) -> dict[str, Any]:
    """Each batch's place, wait and window, in the order they were submitted; and the summary."""
    finish = {b["batch_id"]: rank for rank, b in enumerate(sorted(followed, key=lambda b: b["completed_at"] or 0), 1)}
    rows = []
    for b in sorted(followed, key=lambda b: names[b["batch_id"]][2]):
        name, window, submitted = names[b["batch_id"]]
        waited, window_s = (b["completed_at"] or 0) - b["created_at"], b["expires_at"] - b["created_at"]
        rows.append({"batch_id": b["batch_id"], "name": name, "window": window, "submitted": submitted,
                     "finished": finish[b["batch_id"]], "status": b["status"], "waited_s": waited,
                     "window_s": window_s, "in_window": b["status"] == "completed" and waited <= window_s})
    hour = next(r for r in rows if r["window"] == "1h")
    return {"batches": rows, "summary": {
        "batches": len(rows), "hour_submitted": hour["submitted"], "hour_finished": hour["finished"],
        "hour_ahead_of_queued": sum(1 for r in rows if r["window"] == "24h" and r["finished"] > hour["finished"]),
        "all_in_window": all(r["in_window"] for r in rows)}}


def main() -> None:
    from openai import OpenAI

    from batch_dagster.settings import Settings
    from bench.measure import wait_for_quiet, work_dir
    from bench.small_batch import KEY, serve

    queued = int(os.environ.get("BENCH_DEADLINES_QUEUE") or 4)
    n = int(os.environ.get("BENCH_DEADLINES_REQUESTS") or 30)
    windows = os.environ.get("BENCH_DEADLINES_WINDOWS") or "1h,24h"
    model = os.environ.get("BENCH_MODEL") or "smollm2-135m-instruct"
    out = Path(os.environ.get("BENCH_DEADLINES_OUT") or REPO / "bench" / "results" / "deadlines.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with work_dir("deadlines") as work:
        files = [write_workload(work / f"day-{i}.jsonl", n, model, seed=300 + i) for i in range(queued)]
        hour_file = write_workload(work / "hour.jsonl", n, model, seed=399)
        warm = write_workload(work / "warm.jsonl", n, model, seed=398)
        report: dict[str, Any] = {"meta": {
            "model": model, "queued": queued, "requests": n, "windows": windows, "runs_per_model": 1,
            "machine": machine(), "python": platform.python_version(), "git": git_state(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds")}}
        wait_for_quiet(float(os.environ.get("BENCH_QUIET_WAIT_S") or 600))
        (work / "serve").mkdir()
        settings = {"BATCH_COMPLETION_WINDOWS": windows, "BATCH_RUNS_PER_MODEL": "1"}
        with serve(work / "serve", Settings.from_env().model_cache_dir, settings) as (url, _home, log_path):
            client = OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            print("bench-deadlines: warm-up batch ...", file=sys.stderr, flush=True)
            run_queue(client, [warm], timeout_s=1800)
            print(f"bench-deadlines: {queued} 24h batches x {n} requests, then a 1h batch ...", file=sys.stderr,
                  flush=True)
            days = [submit(client, f, "24h") for f in files]
            # The 1h batch arrives once the queue has formed: the first 24h batch runs, the rest wait for its slot.
            follow(client, days, 600, until=lambda s: any(x["status"] == "in_progress" for b in s.values() for x in b))
            hour = submit(client, hour_file, "1h")
            followed = ends(follow(client, [*days, hour], 3600))
        names = {b: (f"24h #{i + 1}", "24h", i + 1) for i, b in enumerate(days)} | {hour: ("1h", "1h", queued + 1)}
        if bad := [b["batch_id"] for b in followed if b["status"] != "completed"]:
            raise RuntimeError(f"batches did not complete: {bad}; serve's log {log_path}")
        report |= summarize(followed, names)
        # Batches the queue said would miss their deadline (meets_deadline false, their deadline_at_risk event).
        report["at_risk"] = [names[b["batch_id"]][0] for b in followed
                             if any(x["deadline_at_risk_at"] is not None for x in b["samples"])]
        out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        print(markdown(report))


if __name__ == "__main__":
    main()
