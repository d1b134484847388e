"""The error-rate breaker: a batch whose first lines nearly all fail by the requests' own doing stops before its next
shard, so that it spends no more engine time (batchfile/failure.py breaker_tripped counts them)."""

from __future__ import annotations

from collections.abc import Mapping

from batch_dagster.batchfile.failure import ERROR_RATE, breaker_tripped
from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.results import CommittedShard

from .shards import ShardFeature


class ErrorBreaker(ShardFeature):
    """Stops the batch once at least `first_lines` of its lines have ended and at least its error_breaker_rate of
    them failed, or, with its error_breaker_structured, answered off their schema (its `options`, resolved against
    the operator's: None, never)."""

    def __init__(self, first_lines: int, options: BatchOptions):
        self.first_lines, self.options = first_lines, options

    def before(self, done: Mapping[int, CommittedShard]) -> str | None:
        tripped = breaker_tripped(done.values(), self.first_lines, self.options.error_breaker_rate,
                                  bool(self.options.error_breaker_structured))
        return ERROR_RATE if tripped else None
