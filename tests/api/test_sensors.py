"""The API's sensors: in the project's definitions, running by default, with the store as a resource; what a tick
requests when nothing waits, and when a batch waits and then moves."""

from __future__ import annotations

import dagster as dg
import pytest

from batch_dagster.batchfile.folder import Validation
from batch_dagster.definitions import defs
from batch_dagster.resources import ApiStore, BatchStorage
from batch_dagster.sensors import api_batch_sensor, api_batch_status_sensor
from batch_dagster.store import BatchRecord, repo


def test_definitions_carry_the_api_sensors():
    launch = defs.resolve_sensor_def("api_batch_sensor")
    status = defs.resolve_sensor_def("api_batch_status_sensor")
    assert launch.job_name == "batch_job" and launch.minimum_interval_seconds <= 5
    for sensor in (launch, status):
        assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert isinstance(defs.resources["api_store"], ApiStore)


@pytest.fixture
def sensor_env(tmp_path):
    """The sensors' resources on an empty store, and a test Dagster instance."""
    storage = BatchStorage(data_dir=str(tmp_path))
    resources = {"api_store": ApiStore(url=f"sqlite:///{tmp_path / 'api.db'}"), "storage": storage}
    with dg.instance_for_test() as instance:
        yield instance, resources, storage


def tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, resources: dict):
    """One evaluation of `sensor`, as the daemon calls it."""
    return sensor(dg.build_sensor_context(instance=instance, resources=resources))


def test_sensors_skip_when_nothing_waits(sensor_env):
    instance, resources, _ = sensor_env
    launch = tick(api_batch_sensor, instance, resources)  # the store is created on first use
    # A skip, not a SensorResult: no run requested, no partition added.
    assert isinstance(launch, dg.SkipReason) and launch.skip_message == "No new batches."
    assert tick(api_batch_status_sensor, instance, resources).skip_message == "0 batch(es) changed status."


def test_a_waiting_batch_is_launched_once_and_followed(sensor_env):
    instance, resources, storage = sensor_env
    with resources["api_store"].session() as session:
        repo.ensure_owners(session, ["a"])
        batch_id = repo.new_batch_id()
        session.add(BatchRecord(id=batch_id, owner="a", endpoint="/v1/chat/completions", input_file_id="file-x",
                                completion_window="24h", status="validating", created_at=repo.now()))
        session.commit()

    launch = tick(api_batch_sensor, instance, resources)
    assert isinstance(launch, dg.SensorResult)
    [run] = launch.run_requests
    assert (run.partition_key, run.run_key, run.tags) == (batch_id, batch_id,
                                                          {"batch_id": batch_id, "source": "api", "owner": "a"})
    [partitions] = launch.dynamic_partitions_requests
    assert (partitions.partitions_def_name, list(partitions.partition_keys)) == ("batches", [batch_id])
    # Launched: the next tick does not request it again.
    again = tick(api_batch_sensor, instance, resources)
    assert isinstance(again, dg.SkipReason) and again.skip_message == "No new batches."

    # No run yet: nothing to follow. Once its run has validated the file, the batch moves to in_progress.
    assert tick(api_batch_status_sensor, instance, resources).skip_message == "0 batch(es) changed status."
    instance.add_run(dg.DagsterRun(job_name="batch_job", status=dg.DagsterRunStatus.STARTED,
                                   tags={"dagster/partition": batch_id}))
    storage.folder(batch_id).write_validation(Validation(valid=True, total_requests=3, model="m",
                                                         endpoint="/v1/chat/completions", error_count=0, errors=[]))
    assert tick(api_batch_status_sensor, instance, resources).skip_message == "1 batch(es) changed status."
    with resources["api_store"].session() as session:
        batch = repo.get_batch(session, "a", batch_id)
        assert (batch.status, batch.request_total) == ("in_progress", 3)
    assert tick(api_batch_status_sensor, instance, resources).skip_message == "0 batch(es) changed status."
