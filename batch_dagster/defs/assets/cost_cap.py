"""The cost cap as the pipeline applies it: refuse a batch whose upper-bound cost is past what it may spend (at
validation), stop one whose spend has reached it (before each shard)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.results import ShardSummary
from batch_dagster.batchfile.usage import Usage, cost_of
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.db.cost_cap import batch_cap
from batch_dagster.db.session import open_database
from batch_dagster.defs.resources import PipelineConfig
from batch_dagster.features.cost_cap import Cap
from batch_dagster.features.estimate import Tally


def _cap(folder: BatchFolder, model: str, pipeline: PipelineConfig) -> Cap | None:
    """The batch's cap now; None without a store (a CLI run has no key) or when nothing caps it."""
    if not pipeline.store_url:
        return None
    prices = pipeline.prices()
    with open_database(pipeline.store_url).session() as session:
        return batch_cap(session, folder.storage, folder.batch_id, prices, prices.for_model(model).currency,
                         pipeline.key_daily_budget, time.time())


def apply_cost_cap(folder: BatchFolder, report: ValidationReport, pipeline: PipelineConfig,
                   tally: Tally | None) -> None:
    """Over its cap, an error in the valid `report`: the batch's upper-bound cost (its `tally` priced, each request
    at its most output: the estimate's cost.max) is more than it may spend."""
    if not report.valid or report.model is None:
        return
    cap = _cap(folder, report.model, pipeline)
    if cap is None:
        return
    if tally is None:  # its tokenizer failed (count_tokens logged why): no cap is checked by guessing
        raise RuntimeError(f"The batch has a cost cap, and its tokens could not be counted with {report.model}'s "
                           "tokenizer; see the warning above.")
    error = cap.refusal(tally.cost(report.model, pipeline.prices())["max"])
    if error is not None:
        report.errors.append(error)
        report.error_count += 1


def cost_cap_reached(folder: BatchFolder, model: str, committed: Iterable[ShardSummary],
                     pipeline: PipelineConfig) -> bool:
    """Whether the batch, having spent what its `committed` shards cost, must run no other shard."""
    cap = _cap(folder, model, pipeline)
    if cap is None:
        return False
    usage = Usage()
    for shard in committed:
        usage += shard.usage
    return cap.reached(cost_of(usage, model, pipeline.prices()).total_cost)
