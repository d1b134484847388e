"""`make bench-cpu`: the pipeline's CPU stages alone, at the contract's limits and at a tenth of them.

A 200 MB / 50,000-line batch file (the limits) and a 20 MB / 5,000-line one go through the code
paths of the pipeline's CPU steps, each stage in its own process so its peak RSS is its own:

- validate: `validate_file` alone (the goal: >= 100 MB/s).
- requests: `validate_file` feeding the validated requests into a Parquet file, as the
  `validated_requests` asset does (features per request, the body kept as JSON text).
- shard: that Parquet file -> `plan_shards` -> one Parquet file per shard, as `batch_shards` does.
- commit: synthetic results for every shard committed with `results.commit_shard` (the writes of
  `shard_results`, without inference).
- merge: `results.merge` of those shards into the output and error files (`batch_output_files`).

Per stage: seconds (the work only, timed inside the process, imports excluded), MB/s (input
file MB for validate/requests/shard; result MB written for commit/merge), peak RSS of the
process (the larger of 0.2 s sampling and the kernel's VmHWM) and its RSS before the work.
Results to bench/results/cpu_latest.json (BENCH_CPU_OUT) and a table on stdout.
BENCH_CPU_SIZES: file sizes in MB (default "20,200"), 250 lines per MB.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from batch_dagster.storage import LocalStorage
from bench.workload import SEED, TASKS, prose, system_prompts

REPO = Path(__file__).resolve().parent.parent
STAGES = ("validate", "requests", "shard", "commit", "merge")
LINES_PER_MB = 250
SHARD_SIZE = 1000
MODEL = "smollm2-135m-instruct"


# -- the input file ---------------------------------------------------------------------------

def make_file(path: Path, size_bytes: int, lines: int, seed: int = SEED) -> Path:
    """A chat batch file of about size_bytes: half the requests share one of three system prompts,
    and the user texts, spread log-normally, fill the rest of the byte budget."""
    rng = random.Random(seed)
    corpus = prose(rng, 400_000)  # ~2.5 MB of prose to cut user texts from
    systems = system_prompts(seed)

    def line(i: int, system: int | None, task: str, max_tokens: int, text: str) -> bytes:
        messages = [{"role": "system", "content": systems[system]}] if system is not None else []
        messages.append({"role": "user", "content": f"{task} {text}"})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return orjson.dumps({"custom_id": f"req-{i:06d}", "method": "POST", "url": "/v1/chat/completions",
                             "body": body}) + b"\n"

    shapes = [(rng.randrange(3) if rng.random() < 0.5 else None, rng.choice(TASKS), rng.randint(16, 128))
              for _ in range(lines)]
    fixed = sum(len(line(i, *shape, "")) for i, shape in enumerate(shapes))
    weights = [math.exp(rng.gauss(0, 0.8)) for _ in range(lines)]
    scale = max(0, size_bytes - fixed) / sum(weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for i, shape in enumerate(shapes):
            n = max(10, min(int(weights[i] * scale), len(corpus) - 1))
            start = rng.randrange(0, len(corpus) - n)
            f.write(line(i, *shape, corpus[start : start + n]))
    return path


# -- the stages, each run in its own process -----------------------------------------------------

def _registry_models() -> list[str]:
    from batch_dagster.batchfile.registry import load_registry
    from batch_dagster.settings import Settings

    return list(load_registry(Settings.from_env().models_file))


def stage_validate(file: Path, work: Path) -> dict[str, Any]:
    from batch_dagster.batchfile.validate import validate_file

    models = _registry_models()
    t0 = time.perf_counter()
    report = validate_file(file, models=models)
    seconds = time.perf_counter() - t0
    assert report.valid, report.errors[:3]
    return {"seconds": seconds, "mb": file.stat().st_size / 1e6, "rows": report.total_requests}


def stage_requests(file: Path, work: Path) -> dict[str, Any]:
    from batch_dagster.batchfile.columnar import validate_to_parquet

    out = work / "requests.parquet"
    t0 = time.perf_counter()
    report = validate_to_parquet(file, out, models=_registry_models())  # what validated_requests runs
    seconds = time.perf_counter() - t0
    assert report.valid
    return {"seconds": seconds, "mb": file.stat().st_size / 1e6, "rows": report.total_requests,
            "parquet_mb": out.stat().st_size / 1e6}


def stage_shard(file: Path, work: Path) -> dict[str, Any]:
    from batch_dagster.batchfile.columnar import write_shards

    shards_dir = work / "shards"
    shutil.rmtree(shards_dir, ignore_errors=True)
    t0 = time.perf_counter()
    sizes = write_shards(work / "requests.parquet", shards_dir, SHARD_SIZE)  # what batch_shards runs
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mb": file.stat().st_size / 1e6, "rows": sum(sizes), "shards": len(sizes)}


def _synthetic_lines(custom_ids: list[str], rng: random.Random, corpus: str) -> list[dict[str, Any]]:
    """What a shard's inference returns: mostly chat completions, ~2% request errors."""
    from batch_dagster.batchfile import contract as c

    lines = []
    for cid in custom_ids:
        if rng.random() < 0.02:
            lines.append(c.request_error_line(cid, c.CONTEXT_LENGTH_EXCEEDED, "The prompt is too long.",
                                              param="messages"))
            continue
        n = rng.randint(60, 600)
        start = rng.randrange(0, len(corpus) - n)
        completion = max(1, n // 5)
        prompt = rng.randint(20, 1500)
        body = {
            "id": f"chatcmpl-{rng.getrandbits(64):016x}", "object": "chat.completion", "created": 1_800_000_000,
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": corpus[start:start + n]},
                         "logprobs": None, "finish_reason": "length" if completion >= 100 else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": 0}},
        }
        lines.append(c.success_line(cid, body))
    return lines


def stage_commit(file: Path, work: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from batch_dagster.batchfile.results import commit_shard

    results = work / "results"
    shutil.rmtree(results, ignore_errors=True)
    rng = random.Random(SEED)
    corpus = prose(rng, 50_000)
    shard_files = sorted((work / "shards").glob("shard-*.parquet"))
    build_s = commit_s = 0.0
    for index, path in enumerate(shard_files):
        t0 = time.perf_counter()
        lines = _synthetic_lines(pq.read_table(path, columns=["custom_id"])["custom_id"].to_pylist(), rng, corpus)
        t1 = time.perf_counter()
        commit_shard(LocalStorage(work), "results", index, lines, 1.0)
        commit_s += time.perf_counter() - t1
        build_s += t1 - t0
    written = sum(p.stat().st_size for p in results.iterdir())
    return {"seconds": commit_s, "mb": written / 1e6, "shards": len(shard_files),
            "synthetic_lines_s": round(build_s, 3)}


def stage_merge(file: Path, work: Path) -> dict[str, Any]:
    from batch_dagster.batchfile.results import merge

    shard_count = len(list((work / "shards").glob("shard-*.parquet")))
    out, err = work / "output.jsonl", work / "errors.jsonl"
    t0 = time.perf_counter()
    result = merge(LocalStorage(work), "results", shard_count, out, err)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mb": (out.stat().st_size + err.stat().st_size) / 1e6,
            "rows": result.request_counts.total}


RUNNERS = {"validate": stage_validate, "requests": stage_requests, "shard": stage_shard,
           "commit": stage_commit, "merge": stage_merge}


def _status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc: the peak is exact, unlike sampling,
    and unlike ru_maxrss it starts afresh at exec instead of carrying the forking parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(stage: str, file: Path, work: Path) -> None:
    if stage != "validate":
        # pyarrow imports pandas on its first table write: an import, not work (Dagster has it loaded).
        import pandas  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    base = _status_mb("VmRSS")
    result = RUNNERS[stage](file, work)
    result |= {"base_rss_mb": base, "maxrss_mb": _status_mb("VmHWM")}
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


# -- the parent: files, one process per stage, the table ---------------------------------------------

def run_size(mb: float, work: Path) -> dict[str, Any]:
    from bench.measure import run_measured

    lines = max(10, int(mb * LINES_PER_MB))
    file = make_file(work / "input.jsonl", int(mb * 1e6), lines)
    size: dict[str, Any] = {"file_mb": round(file.stat().st_size / 1e6, 1), "lines": lines, "stages": {}}
    for stage in STAGES:
        m = run_measured([sys.executable, "-m", "bench.cpu_bench", "--stage", stage, str(file), str(work)], cwd=REPO)
        if m.returncode != 0:
            raise RuntimeError(f"{stage} failed:\n{m.tail()}")
        r = orjson.loads(m.stdout.strip().splitlines()[-1])
        seconds, mb, base = r.pop("seconds"), r.pop("mb"), r.pop("base_rss_mb")
        peak = max(m.peak_rss_mb, r.pop("maxrss_mb"))
        s = size["stages"][stage] = {
            "seconds": round(seconds, 3), "mb": round(mb, 1), "mb_s": round(mb / max(seconds, 1e-9), 1),
            "peak_rss_mb": round(peak, 1), "base_rss_mb": round(base, 1), "work_rss_mb": round(peak - base, 1),
            "process_wall_s": round(m.wall_s, 2), **r,
        }
        print(f"bench-cpu: {size['file_mb']} MB {stage}: {s['seconds']} s, {s['mb_s']} MB/s, "
              f"peak RSS {s['peak_rss_mb']} MB", file=sys.stderr, flush=True)
    return size


def markdown_table(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    head = ["stage"]
    for s in sizes:
        label = f"{s['file_mb']:g} MB"
        head += [f"{label} s", f"{label} MB/s", f"{label} peak RSS MB"]
    if len(sizes) > 1:
        head.append("RSS growth MB")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage in STAGES:
        cells = [stage]
        for s in sizes:
            r = s["stages"][stage]
            cells += [f"{r['seconds']:.2f}", f"{r['mb_s']:,.0f}", f"{r['peak_rss_mb']:,.0f}"]
        if len(sizes) > 1:
            cells.append(f"{report['rss_growth_mb'][stage]:+,.0f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("file", nargs="?", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("work", nargs="?", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        child(args.stage, args.file, args.work)
        return

    sizes = [float(x) for x in (os.environ.get("BENCH_CPU_SIZES") or "20,200").split(",") if x.strip()]
    out = Path(os.environ.get("BENCH_CPU_OUT") or REPO / "bench" / "results" / "cpu_latest.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench.run_bench import machine

    report: dict[str, Any] = {"meta": {"machine": machine(), "shard_size": SHARD_SIZE,
                                       "lines_per_mb": LINES_PER_MB}, "sizes": []}
    for mb in sizes:
        work = Path(tempfile.mkdtemp(prefix="batch-dagster-bench-cpu-"))
        try:
            report["sizes"].append(run_size(mb, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if len(report["sizes"]) > 1:
        small, large = report["sizes"][0], report["sizes"][-1]
        report["rss_growth_mb"] = {st: round(large["stages"][st]["peak_rss_mb"] - small["stages"][st]["peak_rss_mb"], 1)
                                   for st in STAGES}
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    print(markdown_table(report))
    print(f"\nResults: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
