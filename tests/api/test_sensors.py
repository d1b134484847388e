"""The API's sensors: in the project's definitions, running by default, with the store as a resource; what a tick
requests when nothing waits, and when a batch waits and then moves; the tags the run queue bounds runs by."""

from __future__ import annotations

import dagster as dg
import pytest

from batch_dagster.batchfile.contract import CHAT, EMBEDDINGS
from batch_dagster.batchfile.folder import Validation
from batch_dagster.batchfile.options import BatchOptions, BatchRequest
from batch_dagster.db import BatchRecord, repo
from batch_dagster.db.batches import add_input_file, create_batch
from batch_dagster.definitions import defs as project_defs
from batch_dagster.defs.dagster_internals import GRPC_INFO_TAG
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource
from batch_dagster.defs.sensors import api_batch_sensor, api_batch_status_sensor
from tests.helpers import CHAT_MODEL, EMBED_MODEL, chat_request, free_port, real_vllm, write_jsonl


def test_definitions_carry_the_api_sensors():
    defs = project_defs()
    launch = defs.resolve_sensor_def("api_batch_sensor")
    status = defs.resolve_sensor_def("api_batch_status_sensor")
    assert launch.job_name == "batch_job" and launch.minimum_interval_seconds <= 5
    for sensor in (launch, status):
        assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert isinstance(defs.resources["database"], DatabaseResource)


@pytest.fixture
def sensor_env(tmp_path):
    """The sensors' resources on an empty store, and a test Dagster instance."""
    storage = StorageResource(data_dir=str(tmp_path))
    # The chat model has a warm fleet (nothing listens there: no request is sent); other models run offline.
    resources = {"database": DatabaseResource(url=f"sqlite:///{tmp_path / 'api.db'}"), "storage": storage,
                 "pipeline": PipelineConfig(),
                 "vllm": real_vllm(fleet_urls={CHAT_MODEL: f"http://127.0.0.1:{free_port()}"})}
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
    with resources["database"].session() as session:
        repo.ensure_owners(session, ["a"])
        batch_id = repo.new_batch_id()
        session.add(BatchRecord(id=batch_id, owner="a", endpoint="/v1/chat/completions", input_file_id="file-x",
                                completion_window="24h", status="validating", created_at=repo.now()))
        session.commit()

    launch = tick(api_batch_sensor, instance, resources)
    assert isinstance(launch, dg.SensorResult)
    [run] = launch.run_requests
    # Its input file is not there: the model is unknown, and the run is queued as one that holds an engine.
    assert (run.partition_key, run.run_key, run.tags) == (batch_id, batch_id, {
        "batch_id": batch_id, "source": "api", "owner": "a", "batch/engine": "offline",
        "fair_rank": "0", "dagster/priority": "0"})  # nothing else in flight: it launches first
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
    with resources["database"].session() as session:
        batch = repo.get_batch(session, "a", batch_id)
        assert (batch.status, batch.request_total) == ("in_progress", 3)
    assert tick(api_batch_status_sensor, instance, resources).skip_message == "0 batch(es) changed status."


def test_runs_are_tagged_for_the_run_queue_by_the_model_of_their_file(sensor_env, tmp_path):
    instance, resources, storage = sensor_env
    embed = {"custom_id": "e", "method": "POST", "url": EMBEDDINGS, "body": {"model": EMBED_MODEL, "input": "hi"}}
    files = {"fleet": [chat_request("c", "hi")], "offline": [embed],
             # A first line cut off past the head the sensor reads: no model known.
             "cut": [chat_request("long", "word " * 20_000)]}
    ids = {}
    with resources["database"].session() as session:
        for name, rows in files.items():
            path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
            upload = add_input_file(session, owner="a", file_id=repo.new_file_id(), filename=path.name,
                                    size=path.stat().st_size)
            storage.open().put_file(upload.path, path)  # as the API stores an upload, then copies it in
            request = BatchRequest(owner="a", input_file_id=upload.id, endpoint=EMBEDDINGS if name == "offline" else CHAT)
            ids[name] = create_batch(session, storage.open(), request, upload).id
            session.commit()
    tags = {r.partition_key: r.tags for r in tick(api_batch_sensor, instance, resources).run_requests}

    queue = {name: {k: v for k, v in tags[ids[name]].items() if k.startswith("batch/")} for name in files}
    assert queue == {"fleet": {"batch/engine": "server", "batch/model": CHAT_MODEL},
                     "offline": {"batch/engine": "offline", "batch/model": EMBED_MODEL},
                     "cut": {"batch/engine": "offline"}}


def test_the_vllm_resource_says_which_models_are_served():
    fleet = real_vllm(fleet_urls={CHAT_MODEL: "http://router:8200"})
    assert fleet.queue_tags(CHAT_MODEL) == {"batch/engine": "server", "batch/model": CHAT_MODEL}
    assert fleet.queue_tags(EMBED_MODEL) == {"batch/engine": "offline", "batch/model": EMBED_MODEL}
    assert fleet.queue_tags(None) == {"batch/engine": "offline"}
    servers = real_vllm(mode="server", server_urls=["http://gpu-1:8100"])
    assert servers.queue_tags(EMBED_MODEL) == {"batch/engine": "server", "batch/model": EMBED_MODEL}
    assert real_vllm().queue_tags(CHAT_MODEL)["batch/engine"] == "offline"
    # A run launched without the sensors' tags (from the UI) is counted as holding an engine: a job backfill's
    # runs get the job's definition tags, a launchpad's run its run tags.
    job = project_defs().resolve_job_def("batch_job")
    assert job.tags == job.run_tags == {"batch/engine": "offline"}


def test_a_run_of_an_ended_batch_left_started_by_a_stopped_serve_is_marked_failed(sensor_env):
    # Nothing else would end it, and until it ends it holds its place in the run queue's limits.
    instance, resources, _ = sensor_env
    dead = {GRPC_INFO_TAG: f'{{"host": "127.0.0.1", "port": {free_port()}}}', "batch/engine": "offline"}
    gone = dg.DagsterRun(job_name="batch_job", status=dg.DagsterRunStatus.STARTED, tags=dead)
    running = dg.DagsterRun(job_name="batch_job", status=dg.DagsterRunStatus.STARTED)  # run in-process: no server
    instance.add_run(gone)
    instance.add_run(running)
    tick(api_batch_status_sensor, instance, resources)
    assert instance.get_run_by_id(gone.run_id).status == dg.DagsterRunStatus.FAILURE
    assert instance.get_run_by_id(running.run_id).status == dg.DagsterRunStatus.STARTED


def test_a_batchs_own_priority_goes_before_the_fair_order_and_equals_interleave(sensor_env):
    from batch_dagster.defs.fairness import PRIORITY_TAG, RANK_TAG

    instance, resources, _ = sensor_env
    with resources["database"].session() as session:
        repo.ensure_owners(session, ["a", "b"])
        for i, (owner, priority) in enumerate((("a", 0), ("a", 0), ("a", 0), ("b", 0), ("a", 5), ("b", -2))):
            session.add(BatchRecord(id=f"batch_{i}", owner=owner, endpoint="/v1/chat/completions",
                                    input_file_id="file-x", completion_window="24h", status="validating",
                                    created_at=repo.now(), options=BatchOptions(priority=priority)))
        session.commit()
    requested = tick(api_batch_sensor, instance, resources).run_requests
    tags = {r.partition_key: r.tags for r in requested}
    order = sorted(tags, key=lambda k: -int(tags[k][PRIORITY_TAG]))  # as the run queue launches them (stable)
    # The priority-5 batch first; then the fair order (a's backlog interleaved with b); the lowered one last.
    assert order == ["batch_4", "batch_0", "batch_3", "batch_1", "batch_2", "batch_5"], order
    # The fair part is its own tag: later launches rank against it, not against a batch's own priority; and each
    # priority is a fair queue of its own (a's priority-5 batch and b's lowered one are first in theirs).
    assert [tags[f"batch_{i}"][RANK_TAG] for i in range(6)] == ["0", "-1", "-2", "0", "0", "0"]
