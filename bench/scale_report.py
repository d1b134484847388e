"""The table of `make bench-scale` (bench/scale.py): one row per measurement, one column per database."""

from __future__ import annotations


def _get(d: dict, path: str):
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


ROWS = [
    ("API create p50 / p99 ms", "api.create.p50_ms", "api.create.p99_ms"),
    ("API get p50 / p99 ms", "api.get.p50_ms", "api.get.p99_ms"),
    ("API list p50 / p99 ms", "api.list.p50_ms", "api.list.p99_ms"),
    ("launch tick p50 / max s", "sensors.launch_tick_s.p50", "sensors.launch_tick_s.max"),
    ("burst: last batch launched s", "sensors.burst_last_launched_s", None),
    ("status tick p50 / max s", "sensors.status_tick_s.p50", "sensors.status_tick_s.max"),
    ("event-log rows / batch", "growth.event_rows_per_batch", None),
    ("event-log bytes / batch", "growth.event_bytes_per_batch", None),
    ("step-log bytes / batch", "growth.step_log_bytes_per_batch", None),
    ("Dagster disk bytes / batch", "growth.dagster_disk_bytes_per_batch", None),
]


def rows(results: dict) -> list[tuple[str, list[str]]]:
    out = []
    runs = results["runs"]
    for label, first, second in ROWS:
        cells = []
        for run in runs:
            a, b = _get(run, first), _get(run, second) if second else None
            cells.append("-" if a is None else f"{a} / {b}" if second else f"{a}")
        out.append((label, cells))
    for run_index, run in enumerate(runs):
        for shards, calls in (_get(run, "s3.calls_per_tick") or {}).items():
            label = f"S3 calls / status tick, {shards} shards"
            found = next((r for r in out if r[0] == label), None)
            if found is None:
                found = (label, ["-"] * len(runs))
                out.append(found)
            found[1][run_index] = f"{calls['total']}"
        for count, ui in (_get(run, "ui.by_partitions") or {}).items():
            for page, rendered in ui.get("rendered_s", {}).items():
                queries = {n.split(".", 1)[1]: q for n, q in ui.get("queries_s", {}).items()
                           if n.startswith(f"{page}.")}
                slowest = max(queries, key=lambda n: queries[n]) if queries else None
                worst = f"{queries[slowest]} {slowest}"[:40] if slowest else "-"
                labelled = {f"UI {count}: {page} rendered s": f"{rendered}"[:20],
                         f"UI {count}: {page} slowest query s": worst}
                for label, cell in labelled.items():
                    found = next((r for r in out if r[0] == label), None)
                    if found is None:
                        found = (label, ["-"] * len(runs))
                        out.append(found)
                    found[1][run_index] = cell
    return out


def markdown(results: dict) -> str:
    """The table as markdown, one column per database, for docs/performance.md."""
    names = [run["database"] for run in results["runs"]]
    lines = ["| measurement | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows(results)]
    return "\n".join(lines)


def print_table(results: dict) -> None:
    print()
    print(markdown(results))
    print(f"\nsizes: {results['sizes']}; {results['wall_s']} s in all")
