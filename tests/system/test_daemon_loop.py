"""serve's Dagster daemon looks for due sensors every second (batch_dagster/defs/daemon.py), not Dagster's 5 s: a
batch created through the API is launched, and its end stored, within about a second, not up to 5 s later each. Its
log says what happened (a batch launched, a status changed), not that a sensor looked and found nothing."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from batch_dagster.db.models import SensorTick
from tests.daemon_defs import engine_calls
from tests.helpers import Serve, chat_request, wait_until

pytestmark = pytest.mark.timeout(300)
SENSORS = ("api_batch_sensor", "api_batch_status_sensor")  # each with a minimum interval of 1 s
WATCH_S = 10.0
COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # Dagster's coloured level names


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> Iterator[Serve]:
    tmp_path = tmp_path_factory.mktemp("serve")
    (tmp_path / "hold").mkdir()
    with Serve(tmp_path, module="tests.daemon_defs", BATCH_TEST_CALLS=str(tmp_path / "calls.jsonl"),
               BATCH_TEST_HOLD=str(tmp_path / "hold")) as serve:
        yield serve


def ticks(serve: Serve) -> dict[str, int]:
    """Each sensor's evaluations so far, as the sensors count them in the store (defs/sensor_timing.py)."""
    with serve.store() as session:
        return {row.name: row.ticks for row in session.query(SensorTick).filter(SensorTick.name.in_(SENSORS))}


def test_the_daemon_evaluates_the_api_sensors_about_every_second(serve):
    wait_until(lambda: len(ticks(serve)) == len(SENSORS), 120, serve, "the daemon's first ticks")
    before, started = ticks(serve), time.monotonic()
    time.sleep(WATCH_S)
    after, watched = ticks(serve), time.monotonic() - started
    # Dagster's 5 s loop gives each at most 3 evaluations in 10 s; a 1 s loop about 10 (fewer on a loaded machine,
    # where a loop takes longer than its second).
    made = {name: after[name] - before[name] for name in SENSORS}
    assert all(n >= watched / 2.5 for n in made.values()), (made, watched)


def test_the_log_shows_the_batchs_launch_and_statuses_at_info_and_no_idle_tick(serve):
    wait_until(lambda: len(ticks(serve)) == len(SENSORS) and min(ticks(serve).values()) >= 5, 120, serve,
               "five ticks of each sensor")
    batch = serve.create_batch([chat_request("a", "Say hi.")])
    serve.wait_for(batch.id, {"completed"}, 120)
    ended = re.compile(rf"{batch.id}: \w+ -> completed")
    wait_until(lambda: ended.search(serve.logs(tail=10**9)), 30, serve, "the status sensor's line")
    lines = COLOURS.sub("", serve.logs(tail=10**9)).splitlines()
    info = [line for line in lines if " - INFO - " in line]  # the daemon's and its sensors' lines at info

    # Every event, at info: the sensor launched the batch, Dagster launched its run, the statuses it went through.
    assert any(line.endswith(f"api_batch_sensor - Launching 1 batch(es): {batch.id}") for line in info), lines
    assert any(re.search(r"SensorDaemon - INFO - Completed launch of run \S+ for api_batch_sensor$", line)
               for line in info), lines
    assert any(ended.search(line) for line in info), lines
    # ...and none of the ticks that found nothing: each sensor ticked about every second meanwhile.
    ticking = [line for line in info if "Checking for new runs for sensor" in line or " skipped" in line
               or "No run requests returned" in line or "Priority sorting" in line]
    assert ticking == [], ticking[:5]
    assert min(ticks(serve).values()) >= 5


def test_runs_are_forked_from_the_code_servers_warm_forkserver(serve):
    """serve's daemon starts its code server as batch_dagster.defs.code_server, whose run workers are forked from a
    forkserver that imported Dagster and the project once, not spawned as new interpreters that import them first."""
    import psutil

    def forkservers() -> list[psutil.Process]:
        servers = [p for p in psutil.Process(serve.proc.pid).children(recursive=True)
                   if "batch_dagster.defs.code_server" in p.cmdline()]
        return [c for s in servers for c in s.children() if "multiprocessing.forkserver" in " ".join(c.cmdline())]

    [forkserver] = wait_until(forkservers, 60, serve, "no forkserver under the code server")
    assert "batch_dagster.definitions" in " ".join(forkserver.cmdline())
    # The run's worker (held at its engine call) is the forkserver's child, a process of its own; then it finishes.
    hold = serve.tmp_path / "hold" / "forked"
    hold.touch()
    batch = serve.create_batch([chat_request("forked-1", "Say hi.")])
    [call] = wait_until(lambda: [c for c in engine_calls(serve.tmp_path / "calls.jsonl")
                                 if c["custom_ids"] == ["forked-1"]], 120, serve, "the run's engine call")
    worker = psutil.Process(call["pid"])
    assert worker.ppid() == forkserver.pid and worker.pid != forkserver.pid
    hold.unlink()
    assert serve.wait_for(batch.id, {"completed"}, 120).status == "completed"
