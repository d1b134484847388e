"""Every resource of the definitions, as the environment configures them (see batch_dagster/settings.py)."""

from __future__ import annotations

from typing import Any, Literal, cast

from batch_dagster.settings import Settings

from .database import DatabaseResource
from .drops import intake_from_env
from .pipeline import env_or, pipeline_config_from_env
from .retention import retention_from_env
from .s3 import LazyS3Resource
from .storage import StorageResource
from .vllm import VLLMResource
from .webhooks import webhooks_from_env


def database_from_env(settings: Settings) -> DatabaseResource:
    """The store and the keys, each a `dg.EnvVar` when set: the UI shows the variable, never the password or a key."""
    return DatabaseResource(url=env_or("BATCH_DATABASE_URL", settings.database_url),
                            api_keys=env_or("BATCH_API_KEYS", ""),
                            intake_api_key=env_or("BATCH_INTAKE_API_KEY", ""))


def resources_from_env() -> dict[str, Any]:
    settings = Settings.from_env()
    return {
        "storage": StorageResource(data_dir=str(settings.data_dir), url=settings.storage_url),
        "pipeline": pipeline_config_from_env(settings),
        # Endpoint, region and credentials come from boto3's own variables (AWS_ENDPOINT_URL, AWS_*).
        "s3": LazyS3Resource(),
        "vllm": VLLMResource(
            # BATCH_ENGINE_MODE is free text; the resource's pydantic config rejects any other value.
            mode=cast(Literal["offline", "server"], settings.engine_mode),
            models_file=str(settings.models_file),
            model_cache_dir=str(settings.model_cache_dir),
            server_urls=list(settings.vllm_server_urls),
            server_api_key=env_or("BATCH_VLLM_API_KEY", settings.vllm_api_key),
            max_concurrency=settings.vllm_max_concurrency,
            fleet_urls=dict(settings.fleet_urls),
        ),
        "database": database_from_env(settings),
        "intake": intake_from_env(settings),
        "webhooks": webhooks_from_env(settings),
        "retention": retention_from_env(settings),
    }
