"""The validated requests and the shards as Parquet files, written and read in bounded memory.

Validation streams each valid request into `requests.parquet` (one row group per few thousand
requests); sharding reads only the small planning columns whole, then routes each row group's
rows to their shard files, so memory does not grow with the file.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from .contract import Limits
from .folder import shard_file
from .shard import Features, features, plan_shards
from .validate import ValidationReport, validate_file, validate_stream

REQUESTS_SCHEMA = pa.schema(
    [("line", pa.int64()), ("custom_id", pa.string()), ("body", pa.string()),
     ("prompt_chars", pa.int64()), ("prefix_key", pa.string()), ("max_tokens", pa.int64())]
)
SHARD_SCHEMA = pa.schema([("custom_id", pa.string()), ("body", pa.string())])
ROWS_PER_GROUP = 2_000


def validate_to_parquet(
    source: Path | BinaryIO,
    requests_path: Path,
    *,
    size: int | None = None,
    limits: Limits = Limits(),
    endpoint: str | None = None,
    models: Collection[str] | Mapping[str, Collection[str]] | None = None,
) -> ValidationReport:
    """Validate the input and write its requests to `requests_path`, which exists only if the file is valid.

    `source` is the input file, or a stream of it (e.g. an S3 object) and its `size`.
    """
    tmp = requests_path.with_name(requests_path.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    buffer: dict[str, list[Any]] = {name: [] for name in REQUESTS_SCHEMA.names}
    with pq.ParquetWriter(tmp, REQUESTS_SCHEMA) as writer:

        def flush() -> None:
            writer.write_table(pa.table(buffer, schema=REQUESTS_SCHEMA))
            for column in buffer.values():
                column.clear()

        def keep(line: int, request: dict[str, Any]) -> None:
            f = features(request["url"], request["body"])
            buffer["line"].append(line)
            buffer["custom_id"].append(request["custom_id"])
            buffer["body"].append(orjson.dumps(request["body"]).decode())
            buffer["prompt_chars"].append(f.prompt_chars)
            buffer["prefix_key"].append(f.prefix_key)
            buffer["max_tokens"].append(f.max_tokens)
            if len(buffer["line"]) >= ROWS_PER_GROUP:
                flush()

        if isinstance(source, Path):
            report = validate_file(source, limits=limits, endpoint=endpoint, models=models, on_request=keep)
        else:
            report = validate_stream(source, size=size, limits=limits, endpoint=endpoint, models=models,
                                     on_request=keep)
        if buffer["line"]:
            flush()
    if report.valid:
        os.replace(tmp, requests_path)
    else:
        tmp.unlink(missing_ok=True)
    return report


def shard_path(shards_dir: Path, index: int) -> Path:
    return shards_dir / shard_file(index)


def write_shards(requests_path: Path, shards_dir: Path, shard_size: int) -> list[int]:
    """Cut the requests into shard files (see `plan_shards`); returns each shard's size."""
    source = pq.ParquetFile(requests_path)
    # A requests file validated before max_tokens was kept (a batch resumed across an upgrade) orders by prompt.
    columns = [name for name in ("prompt_chars", "prefix_key", "max_tokens") if name in source.schema_arrow.names]
    planning = source.read(columns=columns).to_pydict()
    outputs = planning.get("max_tokens") or [0] * source.metadata.num_rows
    feats = [Features(*row) for row in zip(planning["prompt_chars"], planning["prefix_key"], outputs, strict=True)]
    plan = plan_shards(feats, shard_size)
    shard_of = np.empty(len(feats), dtype=np.int32)
    for index, rows in enumerate(plan):
        shard_of[rows] = index
    shards_dir.mkdir(parents=True, exist_ok=True)
    writers: dict[int, pq.ParquetWriter] = {}
    try:
        offset = 0
        for group in range(source.num_row_groups):
            table = source.read_row_group(group, columns=SHARD_SCHEMA.names)
            owners = shard_of[offset : offset + table.num_rows]
            offset += table.num_rows
            for index in np.unique(owners):
                writer = writers.get(int(index))
                if writer is None:
                    writer = writers[int(index)] = pq.ParquetWriter(shard_path(shards_dir, int(index)), SHARD_SCHEMA)
                writer.write_table(table.filter(pa.array(owners == index)))
    finally:
        for writer in writers.values():
            writer.close()
    return [len(rows) for rows in plan]


def read_shard(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A shard's requests as (custom_id, body)."""
    table = pq.read_table(path)
    ids, bodies = table["custom_id"].to_pylist(), table["body"].to_pylist()
    return [(cid, orjson.loads(body)) for cid, body in zip(ids, bodies, strict=True)]


def read_requests(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """A requests file's bodies with their input lines, a row group at a time."""
    source = pq.ParquetFile(path)
    for group in range(source.num_row_groups):
        table = source.read_row_group(group, columns=["line", "body"])
        for line, body in zip(table["line"].to_pylist(), table["body"].to_pylist(), strict=True):
            yield line, orjson.loads(body)


def custom_ids(path: Path) -> list[str]:
    """The custom_ids of a requests or shard file, without reading the bodies."""
    return pq.read_table(path, columns=["custom_id"])["custom_id"].to_pylist()
