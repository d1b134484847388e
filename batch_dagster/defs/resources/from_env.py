"""Every resource of the definitions, as the settings configure them (setting_fields.py fills each field from its
setting)."""

from __future__ import annotations

from typing import Any

from batch_dagster.defs.retention import Retention
from batch_dagster.defs.webhooks import WebhookConfig
from batch_dagster.settings import Settings

from .database import DatabaseResource
from .drops import Intake
from .pipeline import PipelineConfig
from .s3 import LazyS3Resource
from .setting_fields import from_settings
from .storage import StorageResource
from .vllm import VLLMResource


def resources_from_env(settings: Settings) -> dict[str, Any]:
    """The resources by key, from `settings`."""
    return {
        "storage": from_settings(StorageResource, settings),
        "pipeline": from_settings(PipelineConfig, settings),
        # Endpoint, region and credentials come from boto3's own variables (AWS_ENDPOINT_URL, AWS_*).
        "s3": LazyS3Resource(),
        "vllm": from_settings(VLLMResource, settings),
        "database": from_settings(DatabaseResource, settings),
        "intake": from_settings(Intake, settings),
        "webhooks": from_settings(WebhookConfig, settings),
        "retention": from_settings(Retention, settings),
    }
