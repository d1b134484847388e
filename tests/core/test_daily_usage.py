"""The daily usage report's pure core: rows and totals per batch and model, the daily series, the chart, the
markdown table, and a finished batch priced from its summary (the Dagster asset is tested in tests/pipeline/)."""

from __future__ import annotations

from datetime import date, datetime

import pandas as pd

from batch_dagster.features.daily_usage import (
    FinishedBatch,
    batch_rows,
    chart_png,
    daily_by_model,
    day_bounds,
    finished_batch,
    markdown_table,
    model_rows,
    totals,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DAY_A, DAY_B = "2026-03-03", "2026-03-04"
OWNER = "owner-a"


def at(day: str, clock: str) -> int:
    return int(datetime.fromisoformat(f"{day}T{clock}+00:00").timestamp())


def fb(batch_id: str, model: str, finished_at: int, **kw) -> FinishedBatch:
    return FinishedBatch(batch_id=batch_id, owner=OWNER, model=model, status="completed", finished_at=finished_at, **kw)


def test_core_rows_totals_and_series():
    assert day_bounds(date(2026, 3, 3)) == (at(DAY_A, "00:00:00"), at(DAY_B, "00:00:00"))
    batches = [
        fb("x", "m1", at(DAY_A, "01:00:00"), requests=2, completed=2, input_tokens=10, output_tokens=30, cost=0.5,
           currency="USD", inference_s=3.0),
        fb("y", "m1", at(DAY_A, "02:00:00"), requests=1, failed=1, input_tokens=5, output_tokens=0, cost=0.25,
           currency="USD", inference_s=1.0),
        fb("z", "m2", at(DAY_A, "00:30:00"), requests=4, completed=4, output_tokens=8),
    ]
    rows = batch_rows(batches)
    assert rows["batch_id"].tolist() == ["z", "x", "y"]
    assert rows.set_index("batch_id").loc["x", "output_tokens_per_s"] == 10.0
    models = model_rows(rows).set_index("model")
    assert models.loc["m1", "batches"] == 2 and models.loc["m1", "output_tokens_per_s"] == 7.5  # 30 / 4 s
    assert models.loc["m1", "cost"] == 0.75 and models.loc["m2", "currency"] == ""
    assert totals(rows) == {"batches": 3, "requests": 7, "completed": 6, "failed": 1, "not_run": 0, "input_tokens": 15,
                            "output_tokens": 38, "total_tokens": 53, "cost": 0.75, "inference_s": 4.0}

    series = daily_by_model(batches + [fb("late", "m2", at(DAY_B, "00:00:00"), output_tokens=99)],
                            date(2026, 3, 1), date(2026, 3, 3))
    assert len(series) == 3 * 2  # every day, every model, zeros where nothing finished
    day_a = series[series["day"] == date(2026, 3, 3)].set_index("model")
    assert day_a.loc["m1", "tokens"] == 45 and day_a.loc["m2", "tokens"] == 8
    assert series[series["day"] == date(2026, 3, 1)]["tokens"].sum() == 0

    assert chart_png(series, "t").startswith(PNG_SIGNATURE)
    assert chart_png(daily_by_model([], date(2026, 3, 1), date(2026, 3, 3)), "empty").startswith(PNG_SIGNATURE)


def test_core_empty_day_and_markdown():
    rows = batch_rows([])
    assert rows.empty and list(model_rows(rows).columns)[:2] == ["model", "batches"]
    assert totals(rows)["batches"] == 0 and totals(rows)["cost"] == 0
    assert markdown_table(model_rows(rows)) == "_no finished batches_"
    table = markdown_table(pd.DataFrame({"model": ["a|b"], "cost": [0.000123456789]}))
    assert table.splitlines() == ["| model | cost |", "|---|---|", "| a\\|b | 0.000123457 |"]


def test_core_finished_batch_prices_from_the_summary():
    summary = {"model": "m1", "usage": {"input_tokens": 9, "output_tokens": 1},
               "cost": {"total_cost": 0.2, "currency": "EUR"}, "inference_s": 2.0}
    b = finished_batch("x", OWNER, "completed", 5, None, {"total": 3, "completed": 2, "failed": 1},
                       {"input_tokens": 7, "output_tokens": 4}, summary)
    # Tokens from the store's record (it is the one record); cost and time from the summary.
    assert (b.model, b.input_tokens, b.output_tokens) == ("m1", 7, 4)
    assert (b.cost, b.currency, b.inference_s) == (0.2, "EUR", 2.0)
    assert (b.requests, b.completed, b.failed) == (3, 2, 1)
    invalid = finished_batch("y", OWNER, "failed", 5, None, {"total": 3}, None, None)
    assert (invalid.model, invalid.cost, invalid.input_tokens, invalid.requests) == ("unknown", 0.0, 0, 3)
    assert (invalid.completed, invalid.failed, invalid.not_run) == (0, 0, 3) and b.not_run == 0
