"""Storage calls per status-sensor tick on S3 (bench/scale.py's `s3` part): moto's S3 server on loopback, every
boto3 call this process makes counted by operation while the sensor ticks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import dagster as dg
import httpx
from sqlalchemy import update

from batch_dagster.db import Database
from batch_dagster.db.models import BatchRecord
from bench.postgres import _free_port
from bench.scale import Sizes, Stores, keys_and_owners, seed_batches, sensor_resources, tick, write_in_progress

BUCKET = "scale-bench"
SHARDS = (2, 8)  # shard counts compared: half of each batch's shards committed


@contextmanager
def moto_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def counted_calls() -> Iterator[Counter]:
    """Every botocore API call made in this process meanwhile, by operation name."""
    from botocore.client import BaseClient

    calls: Counter = Counter()
    original = BaseClient._make_api_call

    def counting(self, operation_name, api_params):
        calls[operation_name] += 1
        return original(self, operation_name, api_params)

    BaseClient._make_api_call = counting
    try:
        yield calls
    finally:
        BaseClient._make_api_call = original


def bench_s3(s: Stores, sizes: Sizes) -> dict:
    """`sizes.s3_active` in-progress batches with their folders on S3 and a started run each, for each shard count of
    SHARDS: the calls one status tick makes, and its seconds."""
    import boto3

    from batch_dagster.defs.sensors import api_batch_status_sensor

    _, owners = keys_and_owners(sizes.keys)
    store = Database(s.store_url)
    out: dict = {"active": sizes.s3_active, "calls_per_tick": {}}
    with moto_server() as url:
        saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                "AWS_DEFAULT_REGION")}
        os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                          AWS_DEFAULT_REGION="us-east-1")
        try:
            boto3.client("s3").create_bucket(Bucket=BUCKET)
            for round_, shards in enumerate(SHARDS):
                resources = sensor_resources(s, storage_url=f"s3://{BUCKET}/shards{shards}")
                folders = resources["storage"].open()
                # Each round its own batches: the previous round's are made terminal first.
                with store.session() as session:
                    session.execute(update(BatchRecord).where(BatchRecord.status == "in_progress")
                                    .values(status="completed"))
                    session.commit()
                active = seed_batches(store, owners, sizes.s3_active, status="in_progress", start=round_ * 1_000_000)
                write = partial(write_in_progress, folders, shards=shards, committed=shards // 2)
                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(write, [batch_id for _, batch_id in active]))
                with s.instance() as instance:
                    for _, batch_id in active:
                        instance.add_run(dg.DagsterRun(job_name="batch_job", status=dg.DagsterRunStatus.STARTED,
                                                       tags={"dagster/partition": batch_id}))
                    with counted_calls() as calls:
                        seconds, _ = tick(api_batch_status_sensor, instance, resources)
                out["calls_per_tick"][str(shards)] = {"total": sum(calls.values()), **dict(calls),
                                                      "tick_s": round(seconds, 3)}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out
