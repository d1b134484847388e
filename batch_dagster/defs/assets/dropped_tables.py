"""A table dropped into the inbox or a bucket with its sidecar: rendered into the batch's input file when its run
starts, and answered into a table of the same format when its results are delivered."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from batch_dagster.batchfile import table as t
from batch_dagster.batchfile import table_files as tf
from batch_dagster.batchfile.contract import Limits
from batch_dagster.batchfile.folder import BatchFolder, Source, TableDrop
from batch_dagster.batchfile.results import iter_lines
from batch_dagster.batchfile.table import RowError, TableRequest, TableSpecError
from batch_dagster.batchfile.table_answers import answers_table
from batch_dagster.batchfile.table_files import Sidecar
from batch_dagster.storage import file_location
from batch_dagster.storage.transfer import S3Client, fetch


def sidecar_uri(uri: str) -> str:
    """Where a dropped table's sidecar is: beside it, named after it."""
    folder, _, name = uri.rpartition("/")
    return f"{folder}/{tf.sidecar_name(name)}"


def fetch_dropped_table(context: dg.AssetExecutionContext, folder: BatchFolder, source: Source, s3: S3Client,
                        limits: Limits) -> None:
    """Fetch the table and its sidecar, render each row into a request (the batch's input file and its File), and
    keep what the delivery needs: the key columns, the sidecar, the rows refused before a request.

    A sidecar that is missing or asks what no row could run, or a template naming a column the table lacks, fails
    the step for good with a message naming the field: the batch then ends failed, saying why."""
    started = time.perf_counter()
    name = source.uri.rsplit("/", 1)[-1]
    with tempfile.TemporaryDirectory(prefix="table-drop-") as scratch:
        local_table, local_sidecar = Path(scratch) / name, Path(scratch) / tf.sidecar_name(name)
        fetch(source.uri, local_table, lambda: s3)
        try:
            fetch(sidecar_uri(source.uri), local_sidecar, lambda: s3)
        except Exception as exc:  # FileNotFoundError locally, ClientError from S3
            raise dg.Failure(f"{name} has no sidecar {tf.sidecar_name(name)} beside it ({type(exc).__name__}): "
                             "a dropped table needs one saying what to ask.", allow_retries=False) from None
        try:
            sidecar = Sidecar.parse(local_sidecar.read_bytes(), tf.sidecar_name(name))
            table = tf.read_table(local_table)
        except TableSpecError as exc:
            raise dg.Failure(f"{tf.sidecar_name(name)}: {exc}", allow_retries=False) from None
        except Exception as exc:  # pyarrow's errors for a file that is not the table its name says
            raise dg.Failure(f"{name} is not a readable {name.rsplit('.', 1)[-1]} table: {str(exc)[:500]}",
                             allow_retries=False) from None
        keys = list(sidecar.key_columns) if sidecar.key_columns is not None else table.column_names
        absent = t.missing_columns(sidecar.request, table.column_names) + [k for k in keys
                                                                            if k not in table.column_names]
        if absent:
            raise dg.Failure(f"{tf.sidecar_name(name)}: column(s) {', '.join(map(repr, absent))} are not in {name}; "
                             f"its columns are {', '.join(table.column_names)}.", allow_retries=False)
        try:
            t.check_key_columns(sidecar.request, keys)
        except TableSpecError as exc:
            raise dg.Failure(f"{tf.sidecar_name(name)}: {exc}", allow_retries=False) from None
        rendered = t.render(sidecar.request, table.select(sidecar.request.columns()).to_pylist(), limits)
        with folder.storage.writing(folder.table_key) as path:
            pq.write_table(table.select(keys), path)
        folder.write_table_drop(TableDrop(filename=name, rows=table.num_rows, row_errors=[
            e.__dict__ for e in rendered.errors], sidecar={"request": sidecar.request.to_dict(), "key_columns": keys}))
        files, key = file_location(folder.storage, source.file_path)
        with files.writing(key) as local:
            local.write_bytes(rendered.payload())
            folder.put_input(local)
    context.log.info(f"Fetched {source.uri} and its sidecar: {table.num_rows} rows, {len(rendered.lines)} requests, "
                     f"{len(rendered.errors)} rows refused before a request, in {time.perf_counter() - started:.1f}s")
    for error in rendered.errors[:20]:
        context.log.warning(error.shown())


def answered_table(folder: BatchFolder, scratch: Path) -> Path | None:
    """A dropped table's answers, written beside its other results (`<name>.answers.<csv|parquet>`), or None for a
    batch that did not come from a table."""
    drop = folder.table_drop()
    if drop is None:
        return None
    request = TableRequest.from_dict(drop.sidecar["request"])
    with folder.storage.local_copy(folder.table_key) as path:
        keys = pq.read_table(path)
    lines = [line for key in (folder.output_key, folder.error_key) if folder.storage.exists(key)
             for line in iter_lines(folder.storage, key)]
    answered, _ = answers_table(request, keys, lines, [RowError(**e) for e in drop.row_errors])
    out = scratch / tf.answered_name(drop.filename)
    tf.write_table(answered, out)
    return out
