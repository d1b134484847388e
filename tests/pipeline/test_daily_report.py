"""The daily usage report: each batch on the UTC day it ended, totals per model and batch, the chart, the schedule.

Its pure core (rows, totals, the chart) is tested in tests/core/test_report.py."""

from __future__ import annotations

import base64
import io
import os
from datetime import UTC, date, datetime
from pathlib import Path
from urllib.parse import unquote

import dagster as dg
import pandas as pd
import pytest
from PIL import Image

from batch_dagster.batchfile.folder import Summary
from batch_dagster.batchfile.results import RequestCounts
from batch_dagster.batchfile.usage import Cost, Usage
from batch_dagster.db import BatchRecord, repo
from batch_dagster.definitions import defs
from batch_dagster.defs.assets.daily_report import report_definitions, report_prefix
from batch_dagster.defs.resources import DatabaseResource, StorageResource
from batch_dagster.features.daily_usage import day_bounds

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT = report_definitions(date(2026, 1, 1))  # the days of BATCH_REPORT_START, as the tests set it (conftest.py)
report_assets = list(REPORT.assets or [])
DAY_A, DAY_B = "2026-03-03", "2026-03-04"
OWNER = "owner-a"


def at(day: str, clock: str) -> int:
    return int(datetime.fromisoformat(f"{day}T{clock}+00:00").timestamp())


@pytest.fixture
def env(data_dir):
    """A temp store and batch storage under the test's data dir, as the report's resources."""
    database = DatabaseResource(url=f"sqlite:///{data_dir / 'api.db'}")
    storage = StorageResource(data_dir=str(data_dir))
    with database.session() as session:
        repo.ensure_owners(session, [OWNER])
    return {"database": database, "storage": storage}


def add(env, batch_id: str, status: str, model: str | None, counts: tuple[int, int, int],
        usage: tuple[int, int] | None = None, cost: float | None = None, inference_s: float = 0.0, **times) -> None:
    """A batch in the store, and its summary.json when it has a cost (a batch that failed validation has none)."""
    total, completed, failed = counts
    usage_dict = {"input_tokens": usage[0], "output_tokens": usage[1], "total_tokens": sum(usage)} if usage else None
    with env["database"].session() as session:
        session.add(BatchRecord(
            id=batch_id, owner=OWNER, endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
            status=status, created_at=at("2026-03-01", "00:00:00"), model=model, request_total=total,
            request_completed=completed, request_failed=failed, usage=usage_dict, **times,
        ))
        session.commit()
    if cost is not None:
        env["storage"].folder(batch_id).write_summary(Summary(
            batch_id=batch_id, status=status, endpoint="/v1/chat/completions", model=model or "",
            request_counts=RequestCounts(total, completed, failed),
            usage=Usage(input_tokens=usage[0], output_tokens=usage[1]) if usage else Usage(),
            cost=Cost(model or "", cost, 0.0, 0.5, "USD"), error_codes={}, inference_s=inference_s,
            output_tokens_per_s=0.0, record={}, output_file="", error_file="", completed_at="",
        ))


def materialize(env, instance, day: str) -> dict:
    result = dg.materialize(report_assets, partition_key=day, resources=env, instance=instance)
    assert result.success
    return result.asset_materializations_for_node("daily_usage_report")[0].metadata


def report_dir(day: str):
    return Path(os.environ["BATCH_DATA_DIR"]) / report_prefix(day)  # the data_dir fixture's storage


def read(day: str, name: str) -> pd.DataFrame:
    """A report table from its Parquet file, checked against its CSV twin."""
    parquet = pd.read_parquet(report_dir(day) / f"{name}.parquet")
    csv = pd.read_csv(report_dir(day) / f"{name}.csv", keep_default_na=False)
    assert list(csv.columns) == list(parquet.columns) and len(csv) == len(parquet)
    assert csv["batch_id" if "batch_id" in csv else "model"].tolist() == parquet.iloc[:, 0].tolist()
    return parquet


def by_model(day: str) -> dict[str, dict]:
    return read(day, "usage_by_model").set_index("model").to_dict("index")


def test_batches_land_on_the_day_they_finished_with_correct_totals(env, instance):
    add(env, "b1", "completed", "m-small", (10, 9, 1), (100, 50), 0.001, 5.0, completed_at=at(DAY_A, "10:00:00"))
    add(env, "b2", "completed", "m-small", (4, 4, 0), (40, 20), 0.0004, 2.0, completed_at=at(DAY_A, "23:59:59"))
    add(env, "b3", "failed", "m-big", (3, 0, 0), failed_at=at(DAY_A, "12:00:00"))  # failed validation: no summary
    add(env, "b4", "completed", "m-big", (5, 5, 0), (500, 250), 0.01, 10.0, completed_at=at(DAY_B, "00:00:00"))
    add(env, "b5", "cancelled", "m-small", (6, 2, 0), (20, 10), 0.0002, 1.0, cancelled_at=at(DAY_B, "08:00:00"),
        cancelling_at=at(DAY_A, "20:00:00"))
    # Started on day A but not finished: in no report.
    add(env, "b6", "in_progress", "m-small", (7, 3, 0), (30, 15), in_progress_at=at(DAY_A, "09:00:00"))

    with env["database"].session() as session:
        found = repo.finished_between(session, *day_bounds(date.fromisoformat(DAY_A)))
    assert sorted(b.id for b in found) == ["b1", "b2", "b3"]

    meta_a = materialize(env, instance, DAY_A)
    meta_b = materialize(env, instance, DAY_B)

    batches_a = read(DAY_A, "usage_by_batch")
    assert batches_a["batch_id"].tolist() == ["b1", "b3", "b2"]  # in the order they finished; b2 at 23:59:59
    assert read(DAY_B, "usage_by_batch")["batch_id"].tolist() == ["b4", "b5"]  # b4 at 00:00:00 the next day

    models_a = by_model(DAY_A)
    small = models_a["m-small"]
    assert (small["batches"], small["requests"], small["completed"], small["failed"]) == (2, 14, 13, 1)
    assert (small["input_tokens"], small["output_tokens"], small["total_tokens"]) == (140, 70, 210)
    assert small["cost"] == pytest.approx(0.0014) and small["currency"] == "USD"
    assert small["output_tokens_per_s"] == pytest.approx(10.0)  # 70 tokens over 7 s, not the mean of 10 and 10
    big = models_a["m-big"]
    assert (big["batches"], big["requests"], big["completed"], big["total_tokens"], big["cost"]) == (1, 3, 0, 0, 0.0)

    models_b = by_model(DAY_B)
    assert models_b["m-big"]["requests"] == 5 and models_b["m-big"]["output_tokens_per_s"] == pytest.approx(25.0)
    assert models_b["m-small"]["completed"] == 2 and models_b["m-small"]["cost"] == pytest.approx(0.0002)

    b1 = batches_a.set_index("batch_id").loc["b1"]
    assert (b1["model"], b1["status"], b1["failed"], b1["output_tokens_per_s"]) == ("m-small", "completed", 1, 10.0)
    assert b1["finished_at"] == "2026-03-03T10:00:00+00:00"

    assert meta_a["batches"].value == 3 and meta_a["requests"].value == 17 and meta_a["total_tokens"].value == 210
    # Every request is counted once: the invalid batch's 3 requests are not_run; b5 was cancelled with 4 not run.
    assert (meta_a["completed"].value, meta_a["failed"].value, meta_a["not_run"].value) == (13, 1, 3)
    assert (meta_b["requests"].value, meta_b["completed"].value, meta_b["not_run"].value) == (11, 7, 4)
    for meta in (meta_a, meta_b):
        assert meta["requests"].value == meta["completed"].value + meta["failed"].value + meta["not_run"].value
    assert batches_a.set_index("batch_id").loc["b3", "not_run"] == 3
    # The UI's per-batch table is the narrow view; the files keep every column.
    header = meta_a["by_batch"].value.splitlines()[0]
    assert header.count("|") - 1 <= 10 and "inference_s" not in header and "not_run" in header
    assert meta_a["cost"].value == pytest.approx(0.0014) and meta_a["dagster/row_count"].value == 3
    assert meta_b["batches"].value == 2 and meta_b["input_tokens"].value == 520
    assert "| m-small | 2 | 14 |" in meta_a["by_model"].value
    assert meta_a["usage_by_batch_parquet"].value == str(report_dir(DAY_A) / "usage_by_batch.parquet")


def test_rerun_rewrites_the_day_without_double_counting(env, instance):
    add(env, "b1", "completed", "m-small", (10, 9, 1), (100, 50), 0.001, 5.0, completed_at=at(DAY_A, "10:00:00"))
    materialize(env, instance, DAY_A)
    materialize(env, instance, DAY_A)
    assert read(DAY_A, "usage_by_batch")["batch_id"].tolist() == ["b1"]
    assert by_model(DAY_A)["m-small"]["requests"] == 10

    # A batch that finished since (a late backfill) is in the re-run, once, and nothing else moves.
    add(env, "b2", "expired", "m-small", (4, 1, 0), (10, 5), 0.0001, 1.0, expired_at=at(DAY_A, "11:00:00"))
    meta = materialize(env, instance, DAY_A)
    assert by_model(DAY_A)["m-small"]["requests"] == 14 and meta["batches"].value == 2
    assert not list(report_dir(DAY_A).glob("*.tmp"))


def test_the_chart_is_a_png_in_the_file_and_the_metadata(env, instance):
    add(env, "old", "completed", "m-big", (5, 5, 0), (500, 250), 0.01, 10.0, completed_at=at("2026-02-10", "12:00:00"))
    add(env, "b1", "completed", "m-small", (10, 9, 1), (100, 50), 0.001, 5.0, completed_at=at(DAY_A, "10:00:00"))
    meta = materialize(env, instance, DAY_A)

    png = (report_dir(DAY_A) / "usage_chart.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    image = Image.open(io.BytesIO(png))
    image.load()
    assert image.format == "PNG" and image.width > 200 and image.height > 200
    prefix = "![tokens and cost per model](data:image/png;base64,"
    chart_md = meta["chart_by_model"].value
    assert chart_md.startswith(prefix) and base64.b64decode(chart_md[len(prefix):-1]) == png
    # Inline in the UI: an SVG image under the 1,000 characters the UI renders without a "[Show Markdown]" link.
    inline = meta["chart"].value
    assert len(inline) < 1000 and inline.startswith("![usage per day](data:image/svg+xml,")
    svg = unquote(inline[len("![usage per day](data:image/svg+xml,"):-1])
    assert svg.startswith("<svg") and svg.count("<path") == 2 and "max 750" in svg  # the old batch, 21 days before
    # The batch 21 days before is in the chart's window but not in the day's tables.
    assert meta["batches"].value == 1 and "m-big" not in by_model(DAY_A)


def test_schedule_builds_yesterday_shortly_after_midnight_utc():
    project_defs = defs()
    schedule = project_defs.resolve_schedule_def("daily_usage_report_schedule")
    assert schedule.cron_schedule == "15 0 * * *" and schedule.execution_timezone == "UTC"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert schedule.job_name == "daily_usage_report_job"
    with dg.build_schedule_context(scheduled_execution_time=datetime(2026, 3, 5, 0, 15, tzinfo=UTC)) as tick:
        requests = schedule.evaluate_tick(tick).run_requests
    assert [r.partition_key for r in requests] == ["2026-03-04"]
    daily = report_assets[0].partitions_def
    assert daily is not None and [s.name for s in REPORT.schedules or []] == [schedule.name]
    # Today is not a partition until it is over, so neither a backfill nor the schedule builds it early.
    with dg.partition_loading_context(effective_dt=datetime(2026, 3, 5, 23, 0, tzinfo=UTC)):
        assert daily.get_last_partition_key() == "2026-03-04"
    report = project_defs.resolve_assets_def("daily_usage_report")
    assert report.group_names_by_key[dg.AssetKey("daily_usage_report")] == "reports"
