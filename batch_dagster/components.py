"""The Dagster components batch-dagster gives a project (`dg list components` lists them; a defs.yaml names one as
`type: batch_dagster.components.TableBatchComponent`)."""

from batch_dagster.defs.table.component import TableBatchComponent

__all__ = ["TableBatchComponent"]
