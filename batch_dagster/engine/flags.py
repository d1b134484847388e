"""The vLLM command-line flags a registry model runs with: one list for the fleet's servers and the in-process engine.

Both paths parse it with vLLM's own server argument parser, so they run the same engine settings, parsers included.
"""

from __future__ import annotations

import json
from typing import Any

from batch_dagster.batchfile.registry import ModelSpec

from .hardware import dtype_choice

# vLLM 0.32 forces a named or required tool call through its parser's structural tag, whose arguments follow the
# tool's parameters only for a tool marked `strict: true`: any other tool's arguments may be any JSON value (SmolLM2
# answered `"Paris"` for get_weather's `{"location": ...}`). "parameter" pins every tool's arguments to its parameters,
# as before structural tags, and constrains the calls a model makes on its own (tool_choice auto) alike. What
# docs/formats.md ("Structured answers") says, and the upstream report, are there.
TOOL_STRICT_LEVEL = "parameter"


def engine_kwargs(spec: ModelSpec, model_path: str) -> dict[str, Any]:
    """The registry's settings as vLLM's engine arguments (`vllm.LLM`'s keywords, `vllm serve`'s engine flags)."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": spec.name,
        "dtype": dtype_choice(spec.dtype).dtype,  # "auto" resolved here: vLLM's "auto" is the checkpoint's
        "seed": spec.seed,
        "tensor_parallel_size": spec.tensor_parallel_size,
    }
    if spec.task == "embed":
        kwargs["runner"] = "pooling"
    if spec.images_per_request:
        kwargs["limit_mm_per_prompt"] = {"image": spec.images_per_request}
    optional = {
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        # 0 means "unset" so a GPU entry can let gpu_memory_utilization size the cache.
        "kv_cache_memory_bytes": spec.kv_cache_memory_bytes or None,
        "reasoning_parser": spec.reasoning_parser,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs | spec.engine_args


def frontend_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """`vllm serve`'s front-end arguments for the registry model: how its OpenAI layer reads answers."""
    kwargs: dict[str, Any] = {
        # Usage carries the prefix cache's hits (prompt_tokens_details.cached_tokens), which are priced apart.
        "enable_prompt_tokens_details": True,
        # The /render routes (vLLM's render server API): validation counts a served model's prompt tokens there, as
        # the server renders them (engine/counting.py). Whoever reaches a replica may already run any request on it.
        "enable_scale_out": True,
    }
    if spec.tool_call_parser:
        kwargs |= {"tool_call_parser": spec.tool_call_parser, "enable_auto_tool_choice": True,
                   "tool_strict_level": TOOL_STRICT_LEVEL}
    return kwargs


def engine_flags(spec: ModelSpec, model_path: str) -> list[str]:
    """Both as command-line flags (`--max-model-len 2048`, `--no-enable-prefix-caching`)."""
    flags: list[str] = []
    for key, value in (engine_kwargs(spec, model_path) | frontend_kwargs(spec)).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def parsed_args(spec: ModelSpec, model_path: str) -> Any:
    """The flags parsed as `vllm serve` parses them (its parser, its checks): what the in-process engine runs."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(engine_flags(spec, model_path))
    validate_parsed_serve_args(args)
    return args
