"""Answered tables as Parquet files where the batch folders live (a local folder or S3, through the Storage
interface): the table batch component's default IO manager, which a project may swap for its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from batch_dagster.batchfile.storage import Storage
from batch_dagster.settings import open_batch_storage

if TYPE_CHECKING:
    import pandas as pd

TABLES = "tables"


def table_key(asset_key: dg.AssetKey, partition: str | None) -> str:
    """Where an asset's table (or one partition of it) is kept in the storage."""
    path = "/".join(quote(part, safe="") for part in asset_key.path)
    return f"{TABLES}/{path}/{quote(partition, safe='') if partition is not None else 'table'}.parquet"


def as_arrow(value: Any) -> pa.Table:
    """A pandas DataFrame or a pyarrow Table as a pyarrow Table (a DataFrame's index is not a column)."""
    if isinstance(value, pa.Table):
        return value
    import pandas as pd

    if isinstance(value, pd.DataFrame):
        return pa.Table.from_pandas(value, preserve_index=False)
    raise TypeError(f"A table is a pandas DataFrame or a pyarrow Table, not {type(value).__name__}.")


def as_pandas(table: pa.Table) -> pd.DataFrame:
    """A pyarrow Table as a pandas DataFrame whose columns keep their types where values are missing (a failed row has
    no answer and no token counts): pandas' nullable boolean, Int64, Float64 and string, where NumPy's bool and int64
    would turn into object and float64. A table written from a DataFrame comes back with that DataFrame's dtypes."""
    if table.schema.pandas_metadata is not None:
        return table.to_pandas()
    return table.to_pandas(types_mapper=_nullable_dtypes().get)


def _nullable_dtypes() -> dict[pa.DataType, Any]:
    import pandas as pd

    return {pa.bool_(): pd.BooleanDtype(), pa.string(): pd.StringDtype(), pa.large_string(): pd.StringDtype(),
            pa.float32(): pd.Float32Dtype(), pa.float64(): pd.Float64Dtype(),
            pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(), pa.uint8(): pd.UInt8Dtype(), pa.uint16(): pd.UInt16Dtype(),
            pa.uint32(): pd.UInt32Dtype(), pa.uint64(): pd.UInt64Dtype()}


def _wants_arrow(context: dg.InputContext) -> bool:
    return context.dagster_type is not None and context.dagster_type.typing_type is pa.Table


class TableIOManager(dg.ConfigurableIOManager):
    """Tables (pandas or pyarrow) as Parquet under `tables/<asset key>/<partition>.parquet` in the batch storage
    (`url`: a local path or s3://bucket/prefix; empty: `data_dir`). A downstream input is read as a pandas DataFrame,
    (with nullable dtypes: as_pandas), or as a pyarrow Table when its type says so; several partitions come as a dict
    by partition key."""

    data_dir: str
    url: str = ""

    def _storage(self) -> Storage:
        return open_batch_storage(self.data_dir, self.url)

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        table = as_arrow(obj)
        partition = context.partition_key if context.has_asset_partitions else None
        key = table_key(context.asset_key, partition)
        storage = self._storage()
        with storage.writing(key) as path:
            pq.write_table(table, path)
        context.add_output_metadata({"path": dg.MetadataValue.path(storage.uri(key)), "rows": table.num_rows})

    def _read(self, storage: Storage, key: str, arrow: bool) -> Any:
        with storage.local_copy(key) as path:
            table = pq.read_table(path)
        return table if arrow else as_pandas(table)

    def load_input(self, context: dg.InputContext) -> Any:
        storage, arrow = self._storage(), _wants_arrow(context)
        if not context.has_asset_partitions:
            return self._read(storage, table_key(context.asset_key, None), arrow)
        keys = context.asset_partition_keys
        if len(keys) == 1:
            return self._read(storage, table_key(context.asset_key, keys[0]), arrow)
        return {pk: self._read(storage, table_key(context.asset_key, pk), arrow) for pk in keys}
