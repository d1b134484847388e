"""Dagster resources: the storage of batch files and the vLLM engine."""

from .storage import BatchStorage
from .vllm import VLLMResource

__all__ = ["BatchStorage", "VLLMResource"]
