"""serve's Dagster daemon looks for due sensors every second (batch_dagster/defs/daemon.py), not Dagster's 5 s: a
batch created through the API is launched, and its end stored, within about a second, not up to 5 s later each."""

from __future__ import annotations

import time

import pytest

from batch_dagster.db.models import SensorTick
from tests.helpers import Serve, wait_until

pytestmark = pytest.mark.timeout(300)
SENSORS = ("api_batch_sensor", "api_batch_status_sensor")  # each with a minimum interval of 1 s
WATCH_S = 10.0


def ticks(serve: Serve) -> dict[str, int]:
    """Each sensor's evaluations so far, as the sensors count them in the store (defs/sensor_timing.py)."""
    with serve.store() as session:
        return {row.name: row.ticks for row in session.query(SensorTick).filter(SensorTick.name.in_(SENSORS))}


def test_the_daemon_evaluates_the_api_sensors_about_every_second(tmp_path):
    with Serve(tmp_path, module="tests.daemon_defs") as serve:
        wait_until(lambda: len(ticks(serve)) == len(SENSORS), 120, serve, "the daemon's first ticks")
        before, started = ticks(serve), time.monotonic()
        time.sleep(WATCH_S)
        after, watched = ticks(serve), time.monotonic() - started
    # Dagster's 5 s loop gives each at most 3 evaluations in 10 s; a 1 s loop about 10 (fewer on a loaded machine,
    # where a loop takes longer than its second).
    made = {name: after[name] - before[name] for name in SENSORS}
    assert all(n >= watched / 2.5 for n in made.values()), (made, watched)
