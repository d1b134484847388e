"""Sensors: API batches (launch, follow, queue position and ETA), drop folders (S3, inbox), file expiry, history
retention and webhooks."""

from .api_batches import api_batch_sensor, api_batch_status_sensor
from .drops import inbox_sensor, s3_sensor, s3_upload_sensor
from .eta import queue_eta_sensor
from .expiry import file_expiry_sensor
from .retention import history_retention_sensor
from .webhooks import webhook_sensor

__all__ = ["api_batch_sensor", "api_batch_status_sensor", "file_expiry_sensor", "history_retention_sensor",
           "inbox_sensor", "queue_eta_sensor", "s3_sensor", "s3_upload_sensor", "webhook_sensor"]
