"""The project's definitions carry the API's sensors, running by default, with the store as a resource."""

from __future__ import annotations

import dagster as dg

from batch_dagster.definitions import defs
from batch_dagster.resources import BatchStorage
from batch_dagster.sensors import api_batch_sensor, api_batch_status_sensor
from batch_dagster.store.resource import ApiStore


def test_definitions_carry_the_api_sensors():
    launch = defs.resolve_sensor_def("api_batch_sensor")
    status = defs.resolve_sensor_def("api_batch_status_sensor")
    assert launch.job_name == "batch_job" and launch.minimum_interval_seconds <= 5
    for sensor in (launch, status):
        assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert isinstance(defs.resources["api_store"], ApiStore)


def test_sensors_skip_when_nothing_waits(tmp_path):
    resources = {"api_store": ApiStore(url=f"sqlite:///{tmp_path / 'api.db'}"),
                 "storage": BatchStorage(data_dir=str(tmp_path))}
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources=resources)
        assert isinstance(api_batch_sensor(context), dg.SkipReason)  # the store is created on first use
        assert isinstance(api_batch_status_sensor(context), dg.SkipReason)
