"""The daily usage report: every batch that finished on a UTC day, per model and per batch, with a 30-day chart.

Each partition is one day; a run rewrites that day's files whole, so a re-run or a backfill never
double counts. The store is the one record of batches, however they arrived.
"""

import base64
from collections.abc import Callable
from datetime import date, timedelta
from functools import partial
from pathlib import Path

import dagster as dg

from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import BatchRecord, repo
from batch_dagster.defs.partitions import daily_partitions
from batch_dagster.defs.resources import DatabaseResource, StorageResource
from batch_dagster.defs.run_tags import OwnerLabels
from batch_dagster.features.daily_usage import (
    FinishedBatch,
    batch_rows,
    batch_view,
    chart_png,
    currencies,
    daily_by_model,
    finished_batch,
    inline_chart_markdown,
    markdown_table,
    model_rows,
    model_view,
    totals,
)

GROUP = "reports"
CHART_DAYS = 30


def report_prefix(day: str) -> str:
    """Where a day's report lives in the storage (beside the batch folders: local disk or S3)."""
    return f"reports/daily/{day}"


def _finished(record: BatchRecord, storage: StorageResource, labels: OwnerLabels) -> FinishedBatch:
    summary = storage.folder(record.id).summary()
    return finished_batch(
        batch_id=record.id, owner=labels.label(record.owner), status=record.status,  # as the run tags show it
        finished_at=getattr(record, f"{record.status}_at"), model=record.model,
        request_counts={"total": record.request_total, "completed": record.request_completed,
                        "failed": record.request_failed},
        usage=record.usage, summary=summary.to_dict() if summary is not None else None,
    )


def _write(storage: Storage, key: str, write: Callable[[Path], object]) -> str:
    """Write one report file atomically (a reader never sees half of it); where it is."""
    with storage.writing(key) as path:
        write(path)
    return storage.uri(key)


def daily_usage_report(
    context: dg.AssetExecutionContext, database: DatabaseResource, storage: StorageResource
) -> dg.MaterializeResult:
    window = context.partition_time_window
    day = window.start.date()
    chart_start = window.end - timedelta(days=CHART_DAYS)
    with database.session() as session:
        records = repo.finished_between(session, int(chart_start.timestamp()), int(window.end.timestamp()))
    context.log.info(f"{len(records)} batches finished in the {CHART_DAYS} days up to {day}")
    labels = database.labels()
    batches = [_finished(r, storage, labels) for r in records]

    by_batch = batch_rows(b for b in batches if b.day == day)
    by_model = model_rows(by_batch)
    day_totals = totals(by_batch)
    context.log.info(
        f"{day}: {day_totals['batches']} batches, {day_totals['requests']} requests, "
        f"{day_totals['total_tokens']} tokens, cost {day_totals['cost']}"
    )

    out, files = report_prefix(context.partition_key), storage.open()
    paths = {}
    for name, frame in (("usage_by_model", by_model), ("usage_by_batch", by_batch)):
        paths[f"{name}_parquet"] = _write(files, f"{out}/{name}.parquet", partial(frame.to_parquet, index=False))
        paths[f"{name}_csv"] = _write(files, f"{out}/{name}.csv", partial(frame.to_csv, index=False))
    series = daily_by_model(batches, chart_start.date(), day)
    currency = currencies(b.currency for b in batches)
    png = chart_png(series, f"Tokens and cost per model, {CHART_DAYS} days to {day} (UTC)", currency=currency)
    # The UI shows Markdown inline only under 1,000 characters: a small SVG there, the full PNG behind a link.
    inline_chart = inline_chart_markdown(series, currency)
    paths["usage_chart_png"] = _write(files, f"{out}/usage_chart.png", lambda p: p.write_bytes(png))
    context.log.info(f"Wrote the report to {files.uri(out)}")

    chart_md = f"![tokens and cost per model](data:image/png;base64,{base64.b64encode(png).decode()})"
    return dg.MaterializeResult(
        metadata={
            "dagster/row_count": len(by_batch),
            "models": len(by_model),
            **day_totals,
            # Totals add costs across currencies; one price file normally has one.
            "currency": currencies(by_batch["currency"]) or "none",
            **({"chart": dg.MetadataValue.md(inline_chart)} if inline_chart else {}),
            "by_model": dg.MetadataValue.md(markdown_table(model_view(by_model))),
            "by_batch": dg.MetadataValue.md(markdown_table(batch_view(by_batch))),
            "chart_by_model": dg.MetadataValue.md(chart_md),
            **{k: dg.MetadataValue.path(p) for k, p in paths.items()},
        }
    )


def report_definitions(start: date) -> dg.Definitions:
    """The daily report: its asset partitioned by UTC day from `start`, its job, and the schedule that builds
    yesterday's report shortly after midnight UTC."""
    report = dg.asset(
        partitions_def=daily_partitions(start),
        group_name=GROUP,
        kinds={"parquet", "csv", "matplotlib"},
        description="Usage and cost of the batches that finished on the day (UTC), per model and per batch, "
                    "as Parquet and CSV, with a PNG chart of tokens and cost per model over the last 30 days.",
    )(daily_usage_report)
    job = dg.define_asset_job(
        "daily_usage_report_job",
        selection=dg.AssetSelection.assets(report),
        description="Build one day's usage report (the partition key is the UTC day).",
        executor_def=dg.multi_or_in_process_executor,  # Dagster's default, whatever batch_job's is
    )
    schedule = dg.build_schedule_from_partitioned_job(
        job,
        name="daily_usage_report_schedule",
        hour_of_day=0,
        minute_of_hour=15,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Builds yesterday's usage report at 00:15 UTC.",
    )
    return dg.Definitions(assets=[report], jobs=[job], schedules=[schedule])
