"""Table batches: the Dagster component that answers each row of a table asset (component.py), its asset's work
(run.py), the Parquet IO manager of its answered tables (io_manager.py), and tables dropped with a sidecar
(drop.py)."""
