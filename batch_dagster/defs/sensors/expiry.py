"""File expiry: files past their `expires_at` are deleted, rows and bytes."""

from __future__ import annotations

import dagster as dg

from batch_dagster.db import repo
from batch_dagster.defs.resources import DatabaseResource, StorageResource
from batch_dagster.defs.sensor_timing import timed


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Deletes files (uploads and batch outputs) whose expires_at has passed: their rows and their bytes.",
)
@timed
def file_expiry_sensor(context: dg.SensorEvaluationContext, database: DatabaseResource,
                       storage: StorageResource) -> dg.SkipReason:
    with database.session() as session:
        expired = repo.expired_files(session)
        for file in expired:
            repo.delete_file(session, storage.open(), file)
    if expired:
        context.log.info(f"Deleted {len(expired)} expired file(s)")
    return dg.SkipReason(f"{len(expired)} expired file(s) deleted.")
