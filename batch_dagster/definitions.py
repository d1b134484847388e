"""The code location's entry point (workspace.yaml, `dagster dev -m batch_dagster.definitions`): the Dagster side's
definitions, built lazily in batch_dagster/defs/definitions.py."""

from batch_dagster.defs.definitions import defs

__all__ = ["defs"]
