"""Sensors that turn files dropped in an S3 bucket or a local inbox into batches, and deliver their results.

Each tick registers the new complete files as batches in the API's store (so the REST API lists
them), adds their partitions and requests their runs; and, for dropped files whose batch has
ended, requests the run that writes the results back. The store, not the cursor, decides what is
new: a (source, version) pair becomes a batch once, whatever happens to the cursor.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import dagster as dg
from dagster_aws.s3 import S3Resource

from batch_dagster.batchfile.contract import CHAT, endpoint_of_head
from batch_dagster.batchfile.table import TableSpecError
from batch_dagster.batchfile.table_files import MAX_SIDECAR_BYTES, SIDECAR_SUFFIX, Sidecar, is_table, sidecar_name
from batch_dagster.db import repo
from batch_dagster.db.batches import HEAD_BYTES, DroppedFile, drop_problem, head_model, register_dropped
from batch_dagster.defs.fairness import PRIORITY_TAG, with_launch_order
from batch_dagster.defs.jobs import batch_job, deliver_results_job
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import DatabaseResource, Intake, StorageResource, VLLMResource
from batch_dagster.defs.run_tags import OWNER_TAG, run_tags
from batch_dagster.defs.sensor_timing import timed
from batch_dagster.features.eta import set_launch_priorities
from batch_dagster.storage.transfer import s3_uri

IGNORED_SUFFIXES = (".part", ".tmp", ".partial", ".crdownload")
MAX_REFUSED = 1000  # refused files the cursor remembers, so that each is logged once (the oldest are forgotten)
T = TypeVar("T")


class Launched(NamedTuple):
    """What a run request needs of a batch the tick registered."""

    id: str
    owner: str
    model: str | None
    expires_at: int | None


def _tick(context: dg.SensorEvaluationContext, intake: Intake, database: DatabaseResource, storage: StorageResource,
          vllm: VLLMResource, new: Sequence[DroppedFile], *, scheme: str, cursor: dict[str, Any]) -> dg.SensorResult:
    """Register the `new` files as batches, request their runs, and request deliveries for ended batches.

    Each file is registered in its own transaction: one that fails (the store refused a value, lost its
    connection) is rolled back and logged, the others go on, and it is tried again on the next tick.
    """
    launched: list[tuple[DroppedFile, Launched]] = []
    with database.session() as session:
        owner = database.intake_owner()
        for f in new:
            try:
                b = register_dropped(session, storage.open(), f, owner=owner,
                                     deliver_to=intake.results_uri(scheme), window=intake.window())
                # Read now: a later file's rollback expires the rows this session holds.
                launched.append((f, Launched(b.id, b.owner, b.model, b.expires_at)))
            except Exception as exc:
                session.rollback()
                context.log.error(f"{f.source[:200]}: could not register it as a batch ({str(exc)[:500]}); "
                                  "it is tried again on the next tick")
        ended = [i.batch_id for i in repo.undelivered(session, scheme)]
        repo.mark_delivery_requested(session, ended)
    for f, batch in launched:
        context.log.info(f"{f.source} ({f.bytes} bytes) -> {batch.id}")
    for batch_id in ended:
        context.log.info(f"{batch_id} ended: delivering its results")
    labels = database.labels()
    tags = with_launch_order(context.instance, batch_job.name, [
        {**run_tags(b.id, way_in="s3" if scheme == "s3://" else "inbox", filename=f.filename, owner=b.owner,
                    model=b.model, vllm=vllm, labels=labels), "input_uri": f.source[:255]}
        for f, b in launched
    ], OWNER_TAG, deadlines=[b.expires_at for _, b in launched]) if launched else []
    if launched:
        with database.session() as session:  # each batch's place in the launch order, for its queue_position
            set_launch_priorities(session, {b.id: int(t[PRIORITY_TAG])
                                            for (_, b), t in zip(launched, tags, strict=True)})
    runs = [
        dg.RunRequest(job_name=batch_job.name, partition_key=b.id, run_key=b.id, tags=t)
        for (_, b), t in zip(launched, tags, strict=True)
    ] + [
        dg.RunRequest(job_name=deliver_results_job.name, partition_key=b, run_key=f"{b}:delivery",
                      tags={"batch_id": b})
        for b in ended
    ]
    return dg.SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=[batches.build_add_request([b.id for _, b in launched])] if launched else [],
        cursor=json.dumps(cursor),
        skip_reason=None if runs else "No new complete file, and no ended batch to deliver.",
    )


def _unknown(context: dg.SensorEvaluationContext, database: DatabaseResource, candidates: list[tuple[str, str, T]],
             refused: list[str]) -> list[T]:
    """The items of (source, version, item) candidates that have not become batches yet, in order.

    Checked before a file's head is read, so a tick reads nothing of the files it already knows. A file whose URI
    or version does not fit the store never becomes a batch: it is logged as refused once (`refused`, kept in
    the cursor, holds its digest) and skipped from then on.
    """
    admissible = []
    for source, version, item in candidates:
        problem = drop_problem(source, version)
        if problem is None:
            admissible.append((source, version, item))
            continue
        digest = hashlib.sha256(f"{source}\n{version}".encode()).hexdigest()[:16]
        if digest not in refused:
            refused.append(digest)
            shown = source if len(source) <= 200 else f"{source[:200]}…"
            context.log.error(f"Refused the dropped file {shown}: {problem}. Rename it to run it.")
    del refused[:-MAX_REFUSED]
    with database.session() as session:
        known = repo.known_sources(session, [source for source, _, _ in admissible])
    return [item for source, version, item in admissible if (source, version) not in known]


def list_s3(client, intake: Intake, start_after: str) -> tuple[list[dict], str]:
    """Up to max_keys_per_tick `.jsonl` objects and Parquet or CSV tables under the prefix after `start_after`, and
    where the next tick starts: after the last key seen, or from the top ("") once the listing reached the end."""
    objects, seen = [], 0
    kwargs = {"Bucket": intake.s3_bucket, "Prefix": intake.s3_prefix}
    while seen < intake.max_keys_per_tick:
        page = client.list_objects_v2(**kwargs, StartAfter=start_after,
                                      MaxKeys=min(1000, intake.max_keys_per_tick - seen))
        contents = page.get("Contents", [])
        seen += len(contents)
        objects += [o for o in contents if (o["Key"].endswith(".jsonl") or is_table(o["Key"]))
                    and not o["Key"].startswith(intake.s3_output_prefix)]
        if not page.get("IsTruncated") or not contents:
            return objects, ""
        start_after = contents[-1]["Key"]
    return objects, start_after


def _table_file(source: str, version: str, name: str, size: int, sidecar: bytes) -> DroppedFile:
    """A dropped table as a batch: its endpoint and model from its sidecar (a sidecar that says neither is reported
    by the batch's run, which fails saying why)."""
    try:
        request = Sidecar.parse(sidecar).request
        endpoint, model = request.endpoint, request.model
    except TableSpecError:
        endpoint, model = CHAT, None
    return DroppedFile(source=source, version=version, filename=name, bytes=size, endpoint=endpoint, model=model)


def _s3_sidecar(client, bucket: str, key: str) -> dict[str, Any] | None:
    """A dropped table's sidecar object (its key and ETag), or None while there is none."""
    folder, _, name = key.rpartition("/")
    sidecar = f"{folder}/{sidecar_name(name)}" if folder else sidecar_name(name)
    try:
        return {"Key": sidecar, "ETag": client.head_object(Bucket=bucket, Key=sidecar)["ETag"]}
    except client.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def watch_s3_bucket(context: dg.SensorEvaluationContext, intake: Intake, s3: S3Resource, database: DatabaseResource,
                    storage: StorageResource, vllm: VLLMResource) -> dg.SensorResult | dg.SkipReason:
    if not intake.s3_bucket:
        return dg.SkipReason("BATCH_S3_BUCKET is not set.")
    if reason := database.no_intake_owner():
        return dg.SkipReason(reason)
    client = s3.get_client()
    cursor = json.loads(context.cursor or "{}")
    refused = cursor.get("refused", [])
    objects, next_start = list_s3(client, intake, cursor.get("start_after", ""))
    found: list[DroppedFile] = []
    candidates = []
    for o in objects:
        version = o["ETag"]
        if is_table(o["Key"]):  # a table is a batch once its sidecar is there: the two versions make its version
            sidecar = _s3_sidecar(client, intake.s3_bucket, o["Key"])
            if sidecar is None:
                continue
            version, o = f"{version}+{sidecar['ETag']}", {**o, "sidecar": sidecar}
        candidates.append((s3_uri(intake.s3_bucket, o["Key"]), version, (version, o)))
    for version, o in _unknown(context, database, candidates, refused):
        uri = s3_uri(intake.s3_bucket, o["Key"])
        if len(found) == intake.max_batches_per_tick:
            next_start = found[-1].source.removeprefix(f"s3://{intake.s3_bucket}/")  # the rest next tick
            break
        name = o["Key"].rsplit("/", 1)[-1]
        if "sidecar" in o:
            sidecar = client.get_object(Bucket=intake.s3_bucket, Key=o["sidecar"]["Key"],
                                        Range=f"bytes=0-{MAX_SIDECAR_BYTES}")["Body"].read()
            found.append(_table_file(uri, version, name, o["Size"], sidecar))
            continue
        body = client.get_object(Bucket=intake.s3_bucket, Key=o["Key"], Range=f"bytes=0-{HEAD_BYTES - 1}")["Body"]
        head = body.read()
        found.append(DroppedFile(source=uri, version=version, filename=name,
                                 bytes=o["Size"], endpoint=endpoint_of_head(head), model=head_model(head)))
    return _tick(context, intake, database, storage, vllm, found, scheme="s3://",
                 cursor={"start_after": next_start, "refused": refused})


def s3_sensor(bucket_set: bool) -> dg.SensorDefinition:
    """The S3 drop sensor; with a bucket set (BATCH_S3_BUCKET, read when the definitions load), it runs from the
    daemon's start."""
    return dg.sensor(
        name="s3_upload_sensor",
        jobs=[batch_job, deliver_results_job],
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING if bucket_set else dg.DefaultSensorStatus.STOPPED,
        description="Runs each new .jsonl object under s3://$BATCH_S3_BUCKET/$BATCH_S3_PREFIX as a batch (and each "
        "Parquet or CSV table with its .batch.yaml sidecar) and writes its results under "
        "$BATCH_S3_OUTPUT_PREFIX<batch_id>/.",
    )(timed(watch_s3_bucket, "s3_upload_sensor"))


# As the declarations' default makes it (no bucket: stopped); the definitions build it from the settings.
s3_upload_sensor = s3_sensor(bucket_set=False)


def _complete_inbox_files(inbox: Path, pending: dict[str, list[int]], settle_s: float, now: float
                          ) -> tuple[list[tuple[os.DirEntry, os.stat_result]], dict[str, list[int]], list[str]]:
    """The inbox's .jsonl files, Parquet and CSV tables and their sidecars unchanged since the previous tick and for
    `settle_s`; the signatures seen now; the symbolic links refused."""
    complete, seen, links = [], {}, []
    with os.scandir(inbox) as entries:
        for entry in entries:
            name = entry.name
            taken = name.endswith((".jsonl", SIDECAR_SUFFIX)) or is_table(name)
            if name.startswith(".") or not taken or name.endswith(IGNORED_SUFFIXES):
                continue
            if entry.is_symlink():  # never followed: it could lead anywhere the daemon can read
                links.append(name)
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            seen[name] = [st.st_size, st.st_mtime_ns]
            if pending.get(name) == seen[name] and now - st.st_mtime >= settle_s:
                complete.append((entry, st))
    return complete, seen, links


@dg.sensor(
    jobs=[batch_job, deliver_results_job],
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Runs each .jsonl file dropped into the inbox folder ($BATCH_INBOX_DIR) as a batch, once it is "
    "completely written (and each Parquet or CSV table with its .batch.yaml sidecar), and writes its results to "
    "<outbox>/<batch_id>/.",
)
@timed
def inbox_sensor(context: dg.SensorEvaluationContext, intake: Intake, database: DatabaseResource,
                 storage: StorageResource, vllm: VLLMResource) -> dg.SensorResult | dg.SkipReason:
    if reason := database.no_intake_owner():
        return dg.SkipReason(reason)
    inbox = Path(intake.inbox_dir)
    inbox.mkdir(parents=True, exist_ok=True)
    cursor = json.loads(context.cursor or "{}")
    refused = cursor.get("refused", [])
    complete, seen, links = _complete_inbox_files(inbox, cursor.get("pending", {}), intake.settle_s, time.time())
    for name in sorted(set(links) - set(cursor.get("links", []))):  # said once, not on every tick
        context.log.warning(f"{inbox / name} is a symbolic link: ignored (the inbox takes regular files only)")
    candidates = []
    sidecars = {entry.name: (entry, st) for entry, st in complete if entry.name.endswith(SIDECAR_SUFFIX)}
    for entry, st in complete:
        source, version = Path(entry.path).resolve().as_uri(), f"{st.st_size}:{st.st_mtime_ns}"
        if entry.name.endswith(SIDECAR_SUFFIX):
            continue
        if is_table(entry.name):  # a batch once its sidecar is complete too; both versions make its version
            sidecar = sidecars.get(sidecar_name(entry.name))
            if sidecar is None:
                continue
            version += f"+{sidecar[1].st_size}:{sidecar[1].st_mtime_ns}"
        candidates.append((source, version, (source, version, entry, st)))
    found = []
    # Files past this tick's cap stay pending: they are complete, and taken on the next ticks.
    for source, version, entry, st in _unknown(context, database, candidates, refused)[: intake.max_batches_per_tick]:
        if is_table(entry.name):
            with open(inbox / sidecar_name(entry.name), "rb") as f:
                found.append(_table_file(source, version, entry.name, st.st_size, f.read(MAX_SIDECAR_BYTES + 1)))
            continue
        with open(entry.path, "rb") as f:
            head = f.read(HEAD_BYTES)
        found.append(DroppedFile(source=source, version=version, filename=entry.name, bytes=st.st_size,
                                 endpoint=endpoint_of_head(head), model=head_model(head)))
    return _tick(context, intake, database, storage, vllm, found, scheme="file://",
                 cursor={"pending": seen, "refused": refused, "links": links})
