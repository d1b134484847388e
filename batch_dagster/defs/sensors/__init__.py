"""Sensors: API batches (launch, follow), drop folders (S3, inbox), file expiry. A feature's own sensors are in its
module of defs/ (the queue's ETA: defs/eta.py; history retention: defs/retention.py; webhooks: defs/webhooks.py)."""

from .api_batches import api_batch_sensor, api_batch_status_sensor
from .drops import inbox_sensor, s3_sensor, s3_upload_sensor
from .expiry import file_expiry_sensor

__all__ = ["api_batch_sensor", "api_batch_status_sensor", "file_expiry_sensor", "inbox_sensor",
           "s3_sensor", "s3_upload_sensor"]
