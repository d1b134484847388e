"""Dagster resources: batch folders, the pipeline's knobs, the engine, the metadata store, the drop folders."""

from .database import DatabaseResource
from .drops import Intake
from .pipeline import PipelineConfig
from .storage import StorageResource
from .vllm import VLLMResource

__all__ = ["DatabaseResource", "StorageResource", "Intake", "PipelineConfig", "VLLMResource"]
