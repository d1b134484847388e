"""Table batches: a Dagster component that answers each row of a table asset, and the Parquet IO manager of its
answered tables."""

from .component import TableBatchComponent
from .io_manager import TableIOManager

__all__ = ["TableBatchComponent", "TableIOManager"]
