"""The arithmetic of `make bench-fleet`: its ratios, the small batch's latency phases and the printed tables.

Pure (no Dagster, vLLM or HTTP): the measuring modules hand it plain numbers and event tuples, and
tests/core/test_bench_workload.py checks it on made-up timelines.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GOALS = {
    "scaling": 1.5,  # output tokens/s of 2 replicas against 1: at least
    "overhead": 1.02,  # pipeline wall time against run_batch's at 500 requests: at most
    "latency_s": 20.0,  # a 3-request API batch, batches.create to completed: at most
    "latency_vs_run_batch": 0.5,  # that time against run_batch's wall time on the same file: at most
    "fixed_cost_s": 2.0,  # that time less the engine's own for the same requests on the warm replica: at most (#46)
}

# Where a small API batch's time goes, in the order it is spent. Each phase ends at a Dagster event:
PHASES = (
    "sensor tick",  # batches.create returned -> the API sensor's run is queued (RUN_ENQUEUED)
    "run queue",  # queued -> taken by the run coordinator and handed to the launcher (RUN_STARTING)
    "run launch",  # dequeued -> the run worker's process is up with the code loaded (RUN_START)
    "between steps",  # a step's end (or RUN_START) -> the next STEP_START: a new process per step, if any
    "validate + shard",  # batch_input, validated_requests (and its check), batch_shards
    "inference",  # shard_results
    "merge + usage",  # batch_output_files, batch_usage and their checks
    "run end",  # the last step -> RUN_SUCCESS
    "status poll",  # -> the API answers `completed` to the client's poll
)
STEP_PHASES = {
    "batch_input": "validate + shard",
    "validated_requests": "validate + shard",
    "batch_shards": "validate + shard",
    "shard_results": "inference",
    "batch_output_files": "merge + usage",
    "batch_usage": "merge + usage",
}
_RUN_MARKS = {"RUN_ENQUEUED": "sensor tick", "RUN_DEQUEUED": "run queue", "RUN_STARTING": "run queue",
              "RUN_START": "run launch",
              "RUN_SUCCESS": "run end", "RUN_FAILURE": "run end"}
_STEP_ENDS = {"STEP_SUCCESS", "STEP_FAILURE", "STEP_UP_FOR_RETRY", "STEP_SKIPPED"}


def step_phase(step_key: str) -> str:
    """The phase of a step: its asset's, for an asset check's step too (`<asset>_<check>`)."""
    for asset in sorted(STEP_PHASES, key=len, reverse=True):
        if step_key == asset or step_key.startswith(asset + "_"):
            return STEP_PHASES[asset]
    raise ValueError(f"unknown step {step_key!r}")


def latency_phases(created: float, seen: float, events: Iterable[tuple[float, str, str | None]]) -> dict[str, float]:
    """Split `seen - created` (seconds) into PHASES, from the run's events as (timestamp, event type, step key).

    Each stretch of time goes to the phase of the event that ends it. The API reports a batch completed
    as soon as its summary is written, which can be before the run's last events: the phase under way at
    `seen` gets the time up to it, and later events are left out. The phases add up to `seen - created`.
    """
    marks = []
    for at, kind, step in events:
        if kind in _RUN_MARKS:
            marks.append((at, _RUN_MARKS[kind]))
        elif kind == "STEP_START":
            marks.append((at, "between steps"))
        elif kind in _STEP_ENDS and step is not None:
            marks.append((at, step_phase(step)))
    out = dict.fromkeys(PHASES, 0.0)
    spent = created
    for at, phase in sorted(marks):
        end = min(max(at, spent), seen)
        out[phase] += end - spent
        spent = end
        if spent >= seen:
            break
    out["status poll"] += seen - spent
    return {k: round(v, 3) for k, v in out.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value}x"


def median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def median_phases(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each phase's median over several batches (so the medians need not add up to the median total)."""
    return {p: statistics.median(r[p] for r in runs) for p in PHASES} if runs else {}


def summarize(report: Mapping[str, Any]) -> dict[str, Any]:
    """The three ratios and whether each meets its goal (None where that part did not run)."""
    out: dict[str, Any] = {}
    scaling = report.get("scaling")
    if scaling and scaling.get("runs"):
        by_replicas = {r["replicas"]: r for r in scaling["runs"]}
        one, two = by_replicas.get(1), by_replicas.get(2)
        value = ratio(two and two["output_tok_s"], one and one["output_tok_s"])
        out["scaling_tok_s_2_vs_1"] = value
        out["scaling_met"] = None if value is None else value >= GOALS["scaling"]
    overhead = report.get("overhead")
    if overhead:
        value = overhead.get("pipeline_vs_run_batch_wall")
        out["overhead_wall_vs_run_batch"] = value
        out["overhead_met"] = None if value is None else value <= GOALS["overhead"]
    latency = report.get("latency")
    if latency:
        api, baseline = latency.get("api_median_s"), latency.get("run_batch_median_s")
        out["latency_api_s"] = api
        out["latency_vs_run_batch"] = ratio(api, baseline)
        out["latency_met"] = None if api is None or out["latency_vs_run_batch"] is None else (
            api <= GOALS["latency_s"] and out["latency_vs_run_batch"] <= GOALS["latency_vs_run_batch"])
        fixed = latency.get("fixed_median_s")
        out["latency_engine_s"], out["latency_fixed_s"] = latency.get("engine_median_s"), fixed
        out["fixed_cost_met"] = None if fixed is None else fixed <= GOALS["fixed_cost_s"]
    return out


def _met(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "-"}[value]


def markdown(report: Mapping[str, Any]) -> str:
    """The results as markdown: the three ratios against their goals, then the small batch's phases."""
    s = report.get("summary") or summarize(report)
    rows = ["| measure | result | goal | met |", "|---|---|---|---|"]
    if "scaling_tok_s_2_vs_1" in s:
        runs = sorted((r["replicas"], r["output_tok_s"]) for r in report["scaling"]["runs"])
        detail = ", ".join(f"{k} replica{'s' if k > 1 else ''} {tok_s:,.1f}" for k, tok_s in runs)
        rows.append(f"| scaling: output tok/s, 2 replicas / 1 ({report['scaling']['requests']:,} requests) | "
                    f"{_x(s['scaling_tok_s_2_vs_1'])} ({detail}) | >= {GOALS['scaling']}x | {_met(s['scaling_met'])} |")
    if "overhead_wall_vs_run_batch" in s:
        o = report["overhead"]
        rows.append(f"| fixed overhead: pipeline wall / run_batch wall ({o['requests']:,} requests) | "
                    f"{s['overhead_wall_vs_run_batch']}x ({o.get('pipeline_wall_s')} s / {o.get('run_batch_wall_s')} s)"
                    f" | <= {GOALS['overhead']}x | {_met(s['overhead_met'])} |")
    if "latency_api_s" in s:
        lat, api, vs = report["latency"], s["latency_api_s"], s["latency_vs_run_batch"]
        rows.append(f"| small batch: {lat['requests']} requests, batches.create -> completed (median of "
                    f"{len(lat['api'])}) | {api} s | <= {GOALS['latency_s']:.0f} s | "
                    f"{_met(None if api is None else api <= GOALS['latency_s'])} |")
        rows.append(f"| small batch: fixed cost, that less the engine's own time for the same requests on the warm "
                    f"replica ({s.get('latency_engine_s')} s), median | {s.get('latency_fixed_s')} s | "
                    f"<= {GOALS['fixed_cost_s']:.0f} s | {_met(s.get('fixed_cost_met'))} |")
        rows.append(f"| small batch: API / run_batch wall ({lat.get('run_batch_median_s')} s) | {_x(vs)} | "
                    f"<= {GOALS['latency_vs_run_batch']}x | "
                    f"{_met(None if vs is None else vs <= GOALS['latency_vs_run_batch'])} |")
    out = "\n".join(rows)
    if s.get("latency_api_s") is not None:
        phases = report["latency"]["phases_median_s"]
        out += "\n\n| small batch phase | median s |\n|---|---:|\n" + "\n".join(
            f"| {p} | {phases[p]:.2f} |" for p in PHASES)
    meta = report.get("meta") or {}
    if meta:
        out += f"\n\nModel {meta.get('model')}, {meta.get('machine')}, commit {meta.get('git')}."
    return out
