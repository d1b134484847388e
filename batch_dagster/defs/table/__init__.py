"""Table batches: the Dagster component that answers each row of a table asset (component.py), its asset's work
(run.py) and the Parquet IO manager of its answered tables (io_manager.py). A table dropped with a sidecar is the
lifecycle's (defs/assets/dropped_tables.py)."""
