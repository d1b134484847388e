"""Dagster resources: batch folders, the pipeline's knobs, the engine, the store, the drop folders. A feature's own
resource is beside its sensor (defs/retention.py, defs/webhooks.py)."""

from .database import DatabaseResource
from .drops import Intake
from .pipeline import PipelineConfig
from .s3 import LazyS3Resource
from .storage import StorageResource
from .vllm import VLLMResource

__all__ = ["DatabaseResource", "StorageResource", "Intake", "LazyS3Resource", "PipelineConfig", "VLLMResource"]
