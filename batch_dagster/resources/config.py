"""The resources as configured by the environment (see settings.py for the variables)."""

from __future__ import annotations

import os
from typing import Any

from dagster_aws.s3 import S3Resource

from batch_dagster.settings import Settings

from .storage import BatchStorage
from .vllm import VLLMResource


def resources_from_env() -> dict[str, Any]:
    settings = Settings.from_env()
    urls = [u.strip() for u in os.environ.get("BATCH_VLLM_SERVER_URLS", "").split(",") if u.strip()]
    return {
        "storage": BatchStorage(data_dir=str(settings.data_dir)),
        # Endpoint, region and credentials come from boto3's own variables (AWS_ENDPOINT_URL, AWS_*).
        "s3": S3Resource(),
        "vllm": VLLMResource(
            mode=os.environ.get("BATCH_ENGINE_MODE", "offline"),
            models_file=str(settings.models_file),
            model_cache_dir=str(settings.model_cache_dir),
            server_urls=urls,
            server_api_key=os.environ.get("BATCH_VLLM_API_KEY") or None,
            max_concurrency=int(os.environ.get("BATCH_VLLM_MAX_CONCURRENCY", "64")),
        ),
    }
