"""`batch-dagster demo`: the sample batch through the pipeline on the default model, then a summary."""

from __future__ import annotations

import json
from pathlib import Path

from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.defs.runner import run_batch
from batch_dagster.settings import Settings

from . import sample_batch_path

SHOWN = ("qa-001", "qa-002", "qa-004", "translate-fr-001", "translate-zh-001", "classify-sentiment-001")


def _question(request: dict) -> str:
    return request["body"]["messages"][-1]["content"]


def run_demo(out_dir: Path, settings: Settings) -> int:
    """Run the sample batch into `out_dir` (its run's log in the settings' data folder) and print what it did; the
    exit code."""
    sample = sample_batch_path()
    requests = {r["custom_id"]: r for r in map(json.loads, sample.read_text(encoding="utf-8").splitlines())}
    print(f"Running {len(requests)} sample requests through Dagster on the default model (first start ~30 s) ...")
    run = run_batch(sample, out_dir, log_dir=settings.data_dir / "logs", settings=settings)
    outcome = run.batch
    if outcome.status != BatchStatus.COMPLETED:
        print(f"The demo batch ended {outcome.status}: {outcome.errors_shown()} (log: {run.log_file})")
        return 1
    rc, usage, cost = outcome.request_counts, outcome.usage, outcome.cost
    assert usage is not None and cost is not None  # a batch that ended has both
    rows = [
        ("batch", outcome.batch_id),
        ("model", outcome.model),
        ("requests", rc.describe()),
        ("input tokens", usage.input_tokens),
        ("output tokens", usage.output_tokens),
        ("throughput", f"{outcome.output_tokens_per_s} output tokens/s"),
        ("cost", f"{cost.total_cost:.6f} {cost.currency} (batch price, {cost.batch_discount:.0%} off)"),
        ("engine", outcome.engine.describe() if outcome.engine else "unknown"),
        ("wall time", f"{run.duration_s:.1f} s"),
        ("output file", run.output_file),
        ("error file", run.error_file),
        ("log", run.log_file),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    answers = {}
    for line in map(json.loads, Path(run.output_file).read_text(encoding="utf-8").splitlines()):
        if line["custom_id"] in SHOWN:
            answers[line["custom_id"]] = line["response"]["body"]["choices"][0]["message"]["content"].strip()
    print("\nA few answers:")
    for cid in SHOWN:
        if cid in answers:
            print(f"\n  [{cid}] {_question(requests[cid])}\n  -> {answers[cid]}")
    print("\nBrowse the run, its assets and checks in the Dagster UI: make dev (http://127.0.0.1:3000)")
    return 0
