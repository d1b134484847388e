"""Dagster resources: batch folders, the pipeline's knobs, the engine, the metadata store, the drop folders."""

from .api_store import ApiStore
from .drops import Intake
from .pipeline import PipelineConfig
from .storage import BatchStorage
from .vllm import VLLMResource

__all__ = ["ApiStore", "BatchStorage", "Intake", "PipelineConfig", "VLLMResource"]
