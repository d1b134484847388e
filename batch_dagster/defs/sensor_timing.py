"""Each sensor's evaluations timed by the sensor itself and recorded in the store (db/metrics.py), where the API's
/metrics reads them: the API loads no Dagster, so it cannot read the instance's tick records."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from batch_dagster.db.metrics import record_tick

log = logging.getLogger("batch_dagster.defs.sensors")


def timed(evaluate: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """`evaluate` (a sensor's function, under @dg.sensor: Dagster reads its parameters through the wrapper) with each
    evaluation's seconds, and whether it raised, recorded through its `database` resource under the sensor's `name`
    (by default the function's); a failed record is logged, never the sensor's failure."""
    sensor = name or evaluate.__name__

    @functools.wraps(evaluate)
    def timed_evaluation(*args: Any, **kwargs: Any) -> Any:
        started, ok = time.perf_counter(), False
        try:
            result = evaluate(*args, **kwargs)
            ok = True
            return result
        finally:
            seconds = time.perf_counter() - started
            try:
                with kwargs["database"].session() as session:
                    record_tick(session, sensor, seconds, ok)
            except Exception as exc:  # the store away: the sensor's own work stands
                log.warning("could not record %s's tick: %r", sensor, exc)

    return timed_evaluation
