"""serve's API tells its daemon of each batch it creates (api/launch_nudge.py), and the daemon ticks the launch sensor
and dequeues its run at once rather than at their loops' next passes (defs/dagster_internals.py `nudged`, #46).
How much sooner is `make bench-fleet`'s to say; here: that a nudge makes the sensor due and wakes both loops, and
that nothing else changes."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
from dagster._core.run_coordinator.queued_run_coordinator import QueuedRunCoordinator
from dagster._core.scheduler.instigation import SensorInstigatorData
from dagster._daemon import sensor
from dagster._daemon.daemon import SensorDaemon
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from batch_dagster.api.launch_nudge import LaunchNudge
from batch_dagster.defs.daemon import LAUNCH_SENSOR
from batch_dagster.defs.dagster_internals import Nudges, nudged
from batch_dagster.defs.sensors.api_batches import api_batch_sensor


@pytest.fixture
def nudges(tmp_path, monkeypatch) -> tuple[Nudges, LaunchNudge]:
    for target, name in [(sensor, "is_under_min_interval"), (SensorDaemon, "core_loop"),
                         (QueuedRunCoordinator, "submit_run"), (QueuedRunCoordinatorDaemon, "core_loop")]:
        monkeypatch.setattr(target, name, getattr(target, name))  # put back after the test
    path = str(tmp_path / "launch.sock")
    return nudged(path, LAUNCH_SENSOR), LaunchNudge(path)


def _sent(nudges: Nudges, api: LaunchNudge) -> None:
    before = nudges.created_at
    api.send()
    deadline = time.time() + 10
    while nudges.created_at == before and time.time() < deadline:
        time.sleep(0.01)
    assert nudges.created_at > before, "the daemon never heard the nudge"


def _ticked(seconds_ago: float) -> SimpleNamespace:
    """A sensor's state as the daemon reads it: when its last tick began."""
    return SimpleNamespace(instigator_data=SensorInstigatorData(last_tick_start_timestamp=time.time() - seconds_ago))


def test_the_launch_sensor_is_the_one_a_nudge_ticks():
    assert LAUNCH_SENSOR == api_batch_sensor.name


def test_a_nudge_makes_the_launch_sensor_due_before_its_interval_and_no_other(nudges):
    daemon, api = nudges
    launch = SimpleNamespace(name=LAUNCH_SENSOR, min_interval_seconds=1)
    status = SimpleNamespace(name="api_batch_status_sensor", min_interval_seconds=1)
    state = _ticked(0.2)  # its last tick began 0.2 s ago
    assert sensor.is_under_min_interval(state, launch) and sensor.is_under_min_interval(state, status)
    _sent(daemon, api)
    assert not sensor.is_under_min_interval(state, launch)  # a batch was created since: it ticks now
    assert sensor.is_under_min_interval(state, status)
    assert sensor.is_under_min_interval(_ticked(0.0), launch)  # a tick begun after the nudge has seen the batch


def test_a_nudge_wakes_the_sensor_loop_between_its_passes(nudges, monkeypatch):
    import dagster._daemon.daemon as daemon_module

    daemon, api = nudges
    passes: list[float] = []

    def sensor_loop(_context, _logger, shutdown_event, **_kwargs):  # Dagster's: a pass, then a wait
        while True:
            passes.append(time.time())
            yield None
            shutdown_event.wait(30)

    monkeypatch.setattr(daemon_module, "execute_sensor_iteration_loop", sensor_loop)
    fake = SimpleNamespace(_logger=logging.getLogger("test"), _threadpool_executor=None,
                           _submit_threadpool_executor=None, instrument_elapsed=None)
    loop = SensorDaemon.core_loop(fake, None, threading.Event())  # type: ignore[arg-type]
    threading.Timer(0.3, api.send).start()
    next(loop)  # the first pass
    next(loop)  # the wait, which the nudge ends, then the second pass
    assert len(passes) == 2 and passes[1] - passes[0] < 15


def test_a_nudge_no_tick_has_served_keeps_the_sensor_loops_waits_short(nudges):
    # A tick of the launch sensor begun before the batch was created is still in flight when the nudge comes: Dagster
    # submits no second one, and the pass the nudge woke is spent. The next passes come at once until a tick begins.
    import dagster._daemon.daemon as daemon_module

    daemon, api = nudges
    waits: list[float] = []

    def sensor_loop(_context, _logger, shutdown_event, **_kwargs):
        while True:
            started = time.monotonic()
            shutdown_event.wait(0.5)  # Dagster's wait between passes
            waits.append(time.monotonic() - started)
            yield None

    launch = SimpleNamespace(name=LAUNCH_SENSOR, min_interval_seconds=1)
    in_flight = _ticked(0.2)
    sensor.is_under_min_interval(in_flight, launch)  # the pass before: its tick began 0.2 s ago
    _sent(daemon, api)
    fake = SimpleNamespace(_logger=logging.getLogger("test"), _threadpool_executor=None,
                           _submit_threadpool_executor=None, instrument_elapsed=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(daemon_module, "execute_sensor_iteration_loop", sensor_loop)
        loop = SensorDaemon.core_loop(fake, None, threading.Event())  # type: ignore[arg-type]
        next(loop)  # the wake the nudge set
        next(loop)  # the tick in flight: not served yet
        assert not sensor.is_under_min_interval(in_flight, launch)  # the pass sees it due, and skips it in flight
        next(loop)
        sensor.is_under_min_interval(_ticked(0.0), launch)  # a pass that sees the tick begun after the nudge
        next(loop)
    assert waits[0] < 0.2 and waits[1] < 0.2 and waits[2] < 0.2  # the wake, then two short looks
    assert waits[3] >= 0.45  # served: the loop waits its pass's time again


def test_a_queued_run_wakes_the_run_queue_between_its_passes(nudges):
    daemon, _api = nudges
    passes: list[float] = []

    class Queue:
        interval_seconds = 30
        _logger = logging.getLogger("test")

        def run_iteration(self, _context):
            passes.append(time.time())
            yield None

    loop = QueuedRunCoordinatorDaemon.core_loop(Queue(), None, threading.Event())  # type: ignore[arg-type]
    while not passes:
        next(loop)
    threading.Timer(0.3, daemon.queue.set).start()  # what submitting a queued run does
    for _ in range(20):  # each wait without a wake is 0.5 s: twenty of them are 10 s of the 30
        next(loop)
        if len(passes) == 2:
            break
    assert len(passes) == 2
    assert not daemon.queue.is_set()


def test_a_nudge_with_no_daemon_listening_is_dropped_silently(tmp_path):
    LaunchNudge(str(tmp_path / "nobody.sock")).send()
    LaunchNudge(None).send()


def test_a_socket_that_cannot_be_bound_leaves_the_daemon_as_it_was(tmp_path, monkeypatch):
    for target, name in [(sensor, "is_under_min_interval"), (SensorDaemon, "core_loop")]:
        monkeypatch.setattr(target, name, getattr(target, name))
    before = sensor.is_under_min_interval, SensorDaemon.core_loop
    nudged(str(tmp_path / "no-such-folder" / "launch.sock"), LAUNCH_SENSOR)
    assert (sensor.is_under_min_interval, SensorDaemon.core_loop) == before
