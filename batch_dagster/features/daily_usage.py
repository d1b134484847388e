"""The daily usage report: finished batches -> per-batch and per-model rows, a daily series, a PNG chart.

Pure: it knows batches, usage and cost, not where they are stored or who runs the report.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: pandas costs seconds, and every run and sensor loads this module
    import pandas as pd

BATCH_COLUMNS = {
    "batch_id": "string", "owner": "string", "model": "string", "status": "string", "finished_at": "string",
    "requests": "int64", "completed": "int64", "failed": "int64", "not_run": "int64", "input_tokens": "int64",
    "output_tokens": "int64",
    "total_tokens": "int64", "cost": "float64", "currency": "string", "inference_s": "float64",
    "output_tokens_per_s": "float64",
}
COUNTED = ("requests", "completed", "failed", "not_run", "input_tokens", "output_tokens", "total_tokens", "cost",
           "inference_s")
MODEL_COLUMNS = {"model": "string", "batches": "int64", **{c: BATCH_COLUMNS[c] for c in COUNTED},
                 "currency": "string", "output_tokens_per_s": "float64"}


@dataclass(frozen=True)
class FinishedBatch:
    """What the report counts of one batch that reached a terminal status (`finished_at`, epoch seconds)."""

    batch_id: str
    owner: str
    model: str
    status: str
    finished_at: int
    requests: int = 0
    completed: int = 0
    failed: int = 0
    not_run: int = 0  # requests in neither file: an invalid file's (a failed run writes a line for each)
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    currency: str = ""
    inference_s: float = 0.0

    @property
    def day(self) -> date:
        return datetime.fromtimestamp(self.finished_at, UTC).date()


def day_bounds(day: date) -> tuple[int, int]:
    """The UTC day as epoch seconds [start, end): 23:59:59 is in the day, 00:00:00 is the next day's."""
    start = datetime.combine(day, time(), UTC)
    return int(start.timestamp()), int((start + timedelta(days=1)).timestamp())


def _rate(tokens: float, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds else 0.0


def batch_rows(batches: Iterable[FinishedBatch]) -> pd.DataFrame:
    """One row per batch, in the order they finished."""
    import pandas as pd
    rows = []
    for b in sorted(batches, key=lambda b: (b.finished_at, b.batch_id)):
        row: dict[str, Any] = asdict(b)
        row["finished_at"] = datetime.fromtimestamp(b.finished_at, UTC).isoformat()
        row["total_tokens"] = b.input_tokens + b.output_tokens
        row["output_tokens_per_s"] = _rate(b.output_tokens, b.inference_s)
        rows.append(row)
    return pd.DataFrame(rows, columns=list(BATCH_COLUMNS)).astype(BATCH_COLUMNS)


def model_rows(by_batch: pd.DataFrame) -> pd.DataFrame:
    """One row per model: sums over its batches; tokens/s is output tokens over inference time, not a mean of rates."""
    import pandas as pd
    if by_batch.empty:
        return pd.DataFrame(columns=list(MODEL_COLUMNS)).astype(MODEL_COLUMNS)
    grouped = by_batch.groupby("model", sort=True)
    out = grouped[list(COUNTED)].sum()
    out.insert(0, "batches", grouped.size())
    # A model has one currency unless its price changed currency; the row then lists both (its cost adds them).
    out["currency"] = grouped["currency"].agg(currencies)
    out["output_tokens_per_s"] = [_rate(t, s) for t, s in zip(out["output_tokens"], out["inference_s"], strict=True)]
    out["cost"] = out["cost"].round(8)
    out["inference_s"] = out["inference_s"].round(3)
    return out.reset_index()[list(MODEL_COLUMNS)].astype(MODEL_COLUMNS)


def currencies(values: Iterable[str]) -> str:
    """The distinct currencies among `values`, comma-separated ("" when nothing was priced)."""
    return ",".join(sorted({c for c in values if c}))


def totals(by_batch: pd.DataFrame) -> dict[str, Any]:
    """The day's totals over all batches and models."""
    sums = {c: by_batch[c].sum().item() if not by_batch.empty else 0 for c in COUNTED}
    sums["cost"] = round(float(sums["cost"]), 8)
    sums["inference_s"] = round(float(sums["inference_s"]), 3)
    return {"batches": len(by_batch), **sums}


def daily_by_model(batches: Iterable[FinishedBatch], first: date, last: date) -> pd.DataFrame:
    """Total tokens and cost per model for each day from `first` to `last` (days without batches are 0)."""
    import pandas as pd
    days = pd.date_range(first, last, freq="D").date
    rows = [{"day": b.day, "model": b.model, "tokens": b.input_tokens + b.output_tokens, "cost": b.cost}
            for b in batches if first <= b.day <= last]
    frame = pd.DataFrame(rows, columns=["day", "model", "tokens", "cost"])
    series = frame.groupby(["day", "model"], as_index=False)[["tokens", "cost"]].sum()
    models = sorted(series["model"].unique())
    grid = pd.MultiIndex.from_product([days, models], names=["day", "model"])
    return series.set_index(["day", "model"]).reindex(grid, fill_value=0).reset_index()


def chart_png(daily: pd.DataFrame, title: str, currency: str = "") -> bytes:
    """Stacked bars of tokens and of cost per model per day, as PNG bytes (matplotlib, no display)."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")  # before pyplot: renders to memory on a machine with no display
    import matplotlib.pyplot as plt

    fig, (ax_tokens, ax_cost) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    try:
        days = sorted(daily["day"].unique())
        labels = [d.strftime("%m-%d") for d in days]
        panels = ((ax_tokens, "tokens", "tokens (input + output)"), (ax_cost, "cost", f"cost {currency}".strip()))
        for ax, value, ylabel in panels:
            bottom = pd.Series(0.0, index=days)
            for model, rows in daily.groupby("model", sort=True):
                height = rows.set_index("day")[value].reindex(days, fill_value=0).astype(float)
                ax.bar(labels, height.values, bottom=bottom.values, label=model)
                bottom += height
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
        if daily["model"].nunique():
            ax_tokens.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        else:
            ax_tokens.text(0.5, 0.5, "no finished batches", ha="center", va="center", transform=ax_tokens.transAxes)
        ax_cost.tick_params(axis="x", labelrotation=90, labelsize="small")
        ax_tokens.set_title(title)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        return buf.getvalue()
    finally:
        plt.close(fig)


# What the UI's tables show (the files have every column): narrow enough to fit the metadata panel.
BATCH_VIEW = ("batch_id", "finished_at", "status", "model", "requests", "completed", "failed", "not_run",
              "total_tokens", "cost")
MODEL_VIEW = ("model", "batches", "requests", "completed", "failed", "not_run", "total_tokens", "cost", "currency",
              "output_tokens_per_s")


def batch_view(by_batch: pd.DataFrame) -> pd.DataFrame:
    """The per-batch rows as the UI shows them: fewer columns, ids cut to 14 characters, times as HH:MM."""
    view = by_batch[list(BATCH_VIEW)].copy()
    view["batch_id"] = [b if len(b) <= 15 else b[:14] + "…" for b in view["batch_id"]]
    view["finished_at"] = [t[11:16] for t in view["finished_at"]]
    return view.rename(columns={"finished_at": "at (UTC)", "total_tokens": "tokens"})


def model_view(by_model: pd.DataFrame) -> pd.DataFrame:
    """The per-model rows as the UI shows them."""
    return by_model[list(MODEL_VIEW)].rename(columns={"total_tokens": "tokens", "output_tokens_per_s": "tokens/s"})


def markdown_table(frame: pd.DataFrame, limit: int = 50) -> str:
    """The first `limit` rows as a Markdown table (what the Dagster UI renders in metadata)."""
    if frame.empty:
        return "_no finished batches_"
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.head(limit).itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    if len(frame) > limit:
        lines.append(f"\n_{len(frame) - limit} more rows in the files_")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|")


def finished_batch(batch_id: str, owner: str, status: str, finished_at: int, model: str | None,
                   request_counts: Mapping[str, int], usage: Mapping[str, Any] | None,
                   summary: Mapping[str, Any] | None) -> FinishedBatch:
    """A batch as the store records it, priced by its summary.json.

    A batch that failed validation has no summary: it ran nothing, so it costs 0, and its requests are not_run.
    """
    summary = summary or {}
    requests = int(request_counts.get("total") or 0)
    completed, failed = int(request_counts.get("completed") or 0), int(request_counts.get("failed") or 0)
    usage = usage or summary.get("usage") or {}
    cost = summary.get("cost") or {}
    return FinishedBatch(
        batch_id=batch_id, owner=owner, status=status, finished_at=finished_at,
        model=model or summary.get("model") or "unknown",
        requests=requests, completed=completed, failed=failed, not_run=max(requests - completed - failed, 0),
        input_tokens=int(usage.get("input_tokens") or 0), output_tokens=int(usage.get("output_tokens") or 0),
        cost=float(cost.get("total_cost") or 0.0), currency=cost.get("currency") or "",
        inference_s=float(summary.get("inference_s") or 0.0),
    )


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def chart_svg(daily: pd.DataFrame, currency: str = "", *, with_cost: bool = True) -> str:
    """A small SVG of total tokens (and cost) per day, compact enough to fit inline in the Dagster UI.

    The UI renders a Markdown metadata value inline only when it is under 1,000 characters; a PNG as
    a data URI never is. Per-model detail stays in the PNG chart and the files.
    """
    per_day = daily.groupby("day", sort=True)[["tokens", "cost"]].sum()
    days = list(per_day.index)
    n = max(len(days), 1)
    step = 92 / n
    width = max(round(step * 0.7, 1), 0.5)
    panels = [("tokens", 22, "#4c72b0", "tokens/day, max")]
    if with_cost:
        panels.append(("cost", 44, "#dd8452", f"cost/day {currency}, max".replace("  ", " ")))
    parts = []
    for column, base, colour, label in panels:
        values = per_day[column].astype(float).tolist()
        top = max(values, default=0.0)
        path = "".join(f"M{8 + i * step:.0f} {base}V{base - max(1, round(16 * v / top))}"
                       for i, v in enumerate(values) if v > 0 and top > 0)
        shown = f"{top:,.0f}" if column == "tokens" else _fmt(top)
        parts.append(f"<text x='0' y='{base - 17}'>{label} {shown}</text>")
        if path:
            parts.append(f"<path d='{path}' stroke='{colour}' stroke-width='{width}'/>")
    height = 50 if with_cost else 28
    if days:
        parts.append(f"<text x='8' y='{height - 1}'>{days[0]:%m-%d}</text>")
        parts.append(f"<text x='100' y='{height - 1}' text-anchor='end'>{days[-1]:%m-%d}</text>")
    return (f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 100 {height}' width='400' "
            f"height='{height * 4}' font-size='3.5' font-family='sans-serif'>{''.join(parts)}</svg>")


def inline_chart_markdown(daily: pd.DataFrame, currency: str = "", limit: int = 999) -> str | None:
    """The SVG chart as a Markdown image of at most `limit` characters (tokens only if cost does not fit)."""
    from urllib.parse import quote

    for with_cost in (True, False):
        md = f"![usage per day](data:image/svg+xml,{quote(chart_svg(daily, currency, with_cost=with_cost))})"
        if len(md) <= limit:
            return md
    return None
