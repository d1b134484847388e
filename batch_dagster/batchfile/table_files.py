"""Tables as files (Parquet or CSV), and tables dropped into the inbox or a bucket: a Parquet or CSV file with a
sidecar beside it that says what to ask, answered into a file of the same format beside its results."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa

from .table import TableRequest, TableSpecError

TABLE_SUFFIXES = (".parquet", ".csv")
SIDECAR_SUFFIX = ".batch.yaml"
MAX_SIDECAR_BYTES = 256 * 1024


def is_table(name: str) -> bool:
    return name.lower().endswith(TABLE_SUFFIXES)


def sidecar_name(table_name: str) -> str:
    """The sidecar of a dropped table: `reviews.csv` -> `reviews.batch.yaml`, in the same folder."""
    stem, _, _ = table_name.rpartition(".")
    return stem + SIDECAR_SUFFIX


def answered_name(table_name: str) -> str:
    """The answered table written with a dropped table's results: `reviews.csv` -> `reviews.answers.csv`."""
    stem, _, suffix = table_name.rpartition(".")
    return f"{stem}.answers.{suffix}"


@dataclass(frozen=True)
class Sidecar:
    """What a dropped table asks (the component's `request` fields) and the columns copied beside the answers
    (`key_columns`; default: every column of the table)."""

    request: TableRequest
    key_columns: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, data: bytes, name: str = "the sidecar") -> Sidecar:
        """From the sidecar's bytes (YAML, or JSON, which is YAML); TableSpecError naming `name` and the field."""
        import yaml

        if len(data) > MAX_SIDECAR_BYTES:
            raise TableSpecError(f"{name} is {len(data)} bytes; a sidecar may be at most {MAX_SIDECAR_BYTES}", name)
        try:
            fields = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise TableSpecError(f"{name} is not YAML or JSON: {str(exc)[:300]}", name) from None
        if not isinstance(fields, dict):
            raise TableSpecError(f"{name} must be a mapping of the request's fields", name)
        keys = fields.pop("key_columns", None)
        if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
            raise TableSpecError("must be a list of column names", "key_columns")
        return cls(TableRequest.from_dict(fields), tuple(keys) if keys is not None else None)


def read_table(path: Path | str) -> pa.Table:
    """A Parquet or CSV file as a table (CSV columns typed as pyarrow infers them; an empty CSV cell is empty, not
    the empty text)."""
    if str(path).lower().endswith(".csv"):
        import pyarrow.csv as pcsv

        return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(strings_can_be_null=True))
    import pyarrow.parquet as pq

    return pq.read_table(path)


def write_table(table: pa.Table, path: Path | str) -> None:
    """A table as Parquet, or as CSV for a `.csv` path (embeddings and other lists as JSON text there)."""
    if str(path).lower().endswith(".csv"):
        import pyarrow.csv as pcsv

        for i, f in enumerate(table.schema):
            if pa.types.is_list(f.type):
                text = [None if v is None else orjson.dumps(v).decode() for v in table.column(i).to_pylist()]
                table = table.set_column(i, f.name, pa.array(text, type=pa.string()))
        pcsv.write_csv(table, path)
        return
    import pyarrow.parquet as pq

    pq.write_table(table, path)
