"""Dropped files: the S3 sensor against a real S3-compatible server on loopback (moto), and the inbox sensor.

Sensors are evaluated as the daemon does and their runs executed in-process against a test
instance; the REST API (openai SDK) must list the batches they create.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource
from openai import OpenAI

from batch_dagster.api.app import create_app
from batch_dagster.api.config import ApiConfig
from batch_dagster.assets.delivery import deliver_results_job, delivered_results
from batch_dagster.intake import inbox_sensor, s3_upload_sensor
from batch_dagster.resources import BatchStorage, VLLMResource
from batch_dagster.resources.intake import Intake
from batch_dagster.sensors import api_batch_status_sensor
from batch_dagster.store.resource import ApiStore

from .api.conftest import ApiServer, fake_vllm
from .conftest import chat_request, free_port, make_defs, real_vllm, wait_http
from .fakes import FakeEngine

BUCKET = "drops"
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a loopback port, found by boto3 through AWS_ENDPOINT_URL like any S3-compatible store."""
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 30, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    for name, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=o["Key"])
    client.delete_bucket(Bucket=BUCKET)


def jsonl(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def requests(n: int, prefix: str = "r", **params) -> list[dict]:
    return [chat_request(f"{prefix}{i}", f"question {i} " + "word " * i, **params) for i in range(n)]


class Daemon:
    """Plays the Dagster daemon for the drop sensors: evaluates them with their cursor, runs what they request."""

    def __init__(self, tmp_path: Path, vllm: VLLMResource, **intake):
        self.data_dir = tmp_path / "data"
        self.storage = BatchStorage(data_dir=str(self.data_dir))
        self.db_url = f"sqlite:///{self.data_dir / 'api.db'}"
        self.intake = Intake(inbox_dir=str(tmp_path / "inbox"), outbox_dir=str(tmp_path / "outbox"),
                             files_dir=str(self.data_dir / "files"), **{"s3_bucket": BUCKET, "settle_s": 0, **intake})
        base = make_defs(self.data_dir, vllm)
        self.resources = {**base.resources, "api_store": ApiStore(url=self.db_url), "intake": self.intake}
        self.defs = dg.Definitions(assets=[*base.assets, delivered_results], asset_checks=base.asset_checks,
                                   jobs=[*base.jobs, deliver_results_job], resources=self.resources)
        self.instance = dg.DagsterInstance.ephemeral()
        self.cursors: dict[str, str | None] = {}

    def tick(self, sensor: dg.SensorDefinition, *, run: bool = True) -> list[tuple[str, str]]:
        """One evaluation of `sensor`; the (job, batch id) of each run it requested, executed unless run=False."""
        context = dg.build_sensor_context(instance=self.instance, resources=self.resources,
                                          cursor=self.cursors.get(sensor.name))
        result = sensor(context)
        if not isinstance(result, dg.SensorResult):
            return []
        self.cursors[sensor.name] = result.cursor
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        requested = [(r.job_name, r.partition_key) for r in result.run_requests or []]
        for r in (result.run_requests or []) if run else []:
            outcome = self.defs.resolve_job_def(r.job_name).execute_in_process(
                partition_key=r.partition_key, instance=self.instance, raise_on_error=False, run_config=QUIET,
                tags={**r.tags, "dagster/partition": r.partition_key})
            assert outcome.success or r.job_name == "batch_job", f"{r.job_name} failed"
        return requested

    def follow(self) -> None:
        """The API's status sensor: brings the stored batches up to date with their runs."""
        api_batch_status_sensor(dg.build_sensor_context(instance=self.instance, resources=self.resources))

    def until_delivered(self, sensor: dg.SensorDefinition) -> list[tuple[str, str]]:
        """Run a dropped file's whole life: launch, follow to the end, deliver. All the runs requested."""
        runs = self.tick(sensor)
        self.follow()
        return runs + self.tick(sensor)

    def api(self, stack) -> OpenAI:
        config = ApiConfig(api_keys=(), database_url=self.db_url, data_dir=self.data_dir,
                           max_upload_bytes=1 << 20, completion_window_s=86_400)
        server = stack.enter_context(ApiServer(create_app(config)))
        return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def s3_lines(client, key: str) -> list[dict]:
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def s3_json(client, key: str) -> dict:
    return json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_s3_drops_become_batches_with_results_beside_them(tmp_path, bucket):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("s3", engine))
    bucket.put_object(Bucket=BUCKET, Key="incoming/labels.jsonl", Body=jsonl(requests(5)))
    bucket.put_object(Bucket=BUCKET, Key="incoming/notes.txt", Body=b"not a batch")
    bucket.put_object(Bucket=BUCKET, Key="elsewhere/other.jsonl", Body=jsonl(requests(2)))

    runs = daemon.until_delivered(s3_upload_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    batch_id = runs[0][1]
    assert runs[1][1] == batch_id
    assert daemon.instance.get_dynamic_partitions("batches") == [batch_id]

    prefix = f"results/{batch_id}/"
    keys = {o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    assert keys == {prefix + "output.jsonl", prefix + "errors.jsonl", prefix + "summary.json"}
    assert sorted(l["custom_id"] for l in s3_lines(bucket, prefix + "output.jsonl")) == [f"r{i}" for i in range(5)]
    assert s3_lines(bucket, prefix + "errors.jsonl") == []
    summary = s3_json(bucket, prefix + "summary.json")
    assert summary["status"] == "completed" and summary["source"] == f"s3://{BUCKET}/incoming/labels.jsonl"
    assert summary["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert summary["cost"]["total_cost"] >= 0 and summary["usage"]["output_tokens"] > 0

    # The REST API lists the batch, with its input file, like an uploaded one.
    from contextlib import ExitStack

    with ExitStack() as stack:
        client = daemon.api(stack)
        listed = client.batches.list().data
        assert [b.id for b in listed] == [batch_id]
        assert listed[0].status == "completed" and listed[0].metadata == {"source": summary["source"]}
        assert listed[0].request_counts.completed == 5
        assert client.files.content(listed[0].input_file_id).read() == jsonl(requests(5))

    # Nothing new: nothing runs. The same bytes uploaded again (same ETag): still nothing.
    assert daemon.tick(s3_upload_sensor) == []
    bucket.put_object(Bucket=BUCKET, Key="incoming/labels.jsonl", Body=jsonl(requests(5)))
    assert daemon.tick(s3_upload_sensor) == []
    assert len(engine.calls) == 1

    # A changed object under the same key is a new batch.
    bucket.put_object(Bucket=BUCKET, Key="incoming/labels.jsonl", Body=jsonl(requests(3, prefix="v2-")))
    runs = daemon.until_delivered(s3_upload_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    second = runs[0][1]
    assert second != batch_id
    assert sorted(l["custom_id"] for l in s3_lines(bucket, f"results/{second}/output.jsonl")) == ["v2-0", "v2-1", "v2-2"]


def test_s3_cursor_survives_restarts_and_lists_incrementally(tmp_path, bucket):
    daemon = Daemon(tmp_path, fake_vllm("s3-inc", FakeEngine()), max_keys_per_tick=2, max_batches_per_tick=1)
    for i in range(4):
        bucket.put_object(Bucket=BUCKET, Key=f"incoming/f{i}.jsonl", Body=jsonl(requests(1, prefix=f"f{i}-")))
    launched = []
    for _ in range(4):
        launched += [b for job, b in daemon.tick(s3_upload_sensor, run=False) if job == "batch_job"]
        assert len(launched) == len(set(launched))
    assert len(launched) == 4  # one per tick: bounded work, the cursor moving through the bucket
    # A restarted daemon with no cursor lists from the top and finds nothing new: the store remembers.
    daemon.cursors.clear()
    for _ in range(3):
        assert daemon.tick(s3_upload_sensor, run=False) == []


def test_s3_sensor_is_off_without_a_bucket(tmp_path):
    daemon = Daemon(tmp_path, fake_vllm("s3-off", FakeEngine()), s3_bucket="")
    context = dg.build_sensor_context(instance=daemon.instance, resources=daemon.resources)
    result = s3_upload_sensor(context)
    assert isinstance(result, dg.SkipReason) and "BATCH_S3_BUCKET" in result.skip_message
    if not os.environ.get("BATCH_S3_BUCKET"):
        assert s3_upload_sensor.default_status == dg.DefaultSensorStatus.STOPPED
    assert inbox_sensor.default_status == dg.DefaultSensorStatus.RUNNING


def test_inbox_waits_for_a_file_to_be_completely_written(tmp_path):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("inbox", engine))
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    rows = requests(6)
    whole = jsonl(rows)
    path = inbox / "todo.jsonl"
    path.write_bytes(whole[: len(whole) // 2])  # half written, cut mid-line
    (inbox / "upload.jsonl.part").write_bytes(whole)  # a copy in progress under a temporary name
    (inbox / ".hidden.jsonl").write_bytes(whole)
    assert daemon.tick(inbox_sensor) == []  # first sight: not known to be complete
    with open(path, "ab") as f:
        f.write(whole[len(whole) // 2:])
    assert daemon.tick(inbox_sensor) == []  # it changed since: still being written
    runs = daemon.until_delivered(inbox_sensor)  # unchanged across two ticks: complete
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    batch_id = runs[0][1]
    results = tmp_path / "outbox" / batch_id
    assert sorted(p.name for p in results.iterdir()) == ["errors.jsonl", "output.jsonl", "summary.json"]
    out = [json.loads(l) for l in (results / "output.jsonl").read_text().splitlines()]
    assert sorted(l["custom_id"] for l in out) == sorted(r["custom_id"] for r in rows)
    assert json.loads((results / "summary.json").read_text())["source"] == path.resolve().as_uri()
    assert daemon.tick(inbox_sensor) == []
    assert len(engine.calls) == 1


def test_an_invalid_dropped_file_gets_its_errors_beside_it(tmp_path):
    engine = FakeEngine()
    daemon = Daemon(tmp_path, fake_vllm("inbox-bad", engine))
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    (inbox / "bad.jsonl").write_bytes(jsonl([chat_request("a", "hi"), "{oops", chat_request("a", "again")]))
    daemon.tick(inbox_sensor)  # first sight
    runs = daemon.until_delivered(inbox_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    results = tmp_path / "outbox" / runs[0][1]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["files"] == []
    assert [(e["code"], e["line"]) for e in summary["errors"]] == [("invalid_json", 2), ("duplicate_custom_id", 3)]
    assert engine.calls == []


@pytest.mark.engine
def test_drops_on_the_real_engine(tmp_path, bucket):
    daemon = Daemon(tmp_path, real_vllm())
    rows = [chat_request(f"q{i}", f"Name a colour number {i}.", max_tokens=8, temperature=0) for i in range(3)]
    bucket.put_object(Bucket=BUCKET, Key="incoming/colours.jsonl", Body=jsonl(rows))
    inbox = Path(daemon.intake.inbox_dir)
    inbox.mkdir(parents=True)
    (inbox / "colours.jsonl").write_bytes(jsonl(rows))
    daemon.tick(inbox_sensor)  # first sight of the inbox file

    s3_runs = daemon.until_delivered(s3_upload_sensor)
    inbox_runs = daemon.until_delivered(inbox_sensor)
    s3_batch, inbox_batch = s3_runs[0][1], inbox_runs[0][1]
    from_s3 = s3_lines(bucket, f"results/{s3_batch}/output.jsonl")
    from_inbox = [json.loads(l) for l in (tmp_path / "outbox" / inbox_batch / "output.jsonl").read_text().splitlines()]
    for lines in (from_s3, from_inbox):
        assert sorted(l["custom_id"] for l in lines) == ["q0", "q1", "q2"]
        assert all(l["response"]["status_code"] == 200 for l in lines)
    answers = lambda lines: {l["custom_id"]: l["response"]["body"]["choices"][0]["message"]["content"] for l in lines}
    assert answers(from_s3) == answers(from_inbox)  # temperature 0, same engine: the same answers
    assert s3_json(bucket, f"results/{s3_batch}/summary.json")["usage"]["output_tokens"] > 0


def test_configuration_from_the_environment(tmp_path, monkeypatch):
    from batch_dagster.resources.intake import intake_from_env
    from batch_dagster.store import repo

    monkeypatch.setenv("BATCH_DATA_DIR", str(tmp_path / "data"))
    for name in ("BATCH_S3_BUCKET", "BATCH_INBOX_DIR", "BATCH_OUTBOX_DIR", "BATCH_INTAKE_API_KEY", "BATCH_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    default = intake_from_env()
    assert (default.s3_bucket, default.s3_prefix, default.s3_output_prefix) == ("", "incoming/", "results/")
    assert Path(default.inbox_dir) == tmp_path / "data" / "inbox"
    assert Path(default.outbox_dir) == tmp_path / "data" / "outbox"
    assert default.owner == repo.ANONYMOUS
    monkeypatch.setenv("BATCH_API_KEYS", "sk-first,sk-second")
    assert intake_from_env().owner == repo.owner_of_key("sk-first")  # the API lists them to that key
    monkeypatch.setenv("BATCH_INTAKE_API_KEY", "sk-second")
    monkeypatch.setenv("BATCH_S3_BUCKET", "in")
    configured = intake_from_env()
    assert configured.owner == repo.owner_of_key("sk-second") and configured.s3_results_uri() == "s3://in/results/"
