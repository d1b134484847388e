"""The dtype a model runs in on this host: /proc/cpuinfo read, "auto" resolved before vLLM sees it, the
prepared folder named by its dtype."""

from __future__ import annotations

from pathlib import Path

from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.engine import hardware
from batch_dagster.engine.flags import engine_kwargs
from batch_dagster.engine.prepare import smollm2_path

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_cpu_flags_come_from_the_first_flags_line(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    flags = hardware.cpu_flags(path)
    assert {"avx2", "avx512_bf16"} <= flags and "sysret_ss_attrs" not in flags
    assert hardware.cpu_flags(tmp_path / "absent") == frozenset()


def test_auto_is_resolved_before_it_reaches_vllm():
    chosen = hardware.dtype_choice("auto")
    assert engine_kwargs(ModelSpec(name="m", source="/w"), "/w")["dtype"] == chosen.dtype in ("bfloat16", "float32")
    assert engine_kwargs(ModelSpec(name="m", source="/w", dtype="float16"), "/w")["dtype"] == "float16"


def test_the_choice_records_the_features_that_made_it():
    chosen = hardware.dtype_choice("auto")
    record = chosen.record()
    assert record["registry_dtype"] == "auto" and record["dtype"] == chosen.dtype
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in hardware.cpu_flags()]
    assert record["cpu_bf16_flags"] == native
    if native:  # this host's CPU decides alone: no GPU was looked for
        assert (chosen.dtype, record["gpu"]) == ("bfloat16", None)
    named = hardware.dtype_choice("float16").record()
    assert (named["dtype"], named["reason"]) == ("float16", "named in the registry")


def test_each_dtype_has_its_own_prepared_folder():
    cache = Path("/cache")
    assert smollm2_path(cache, "bfloat16") != smollm2_path(cache, "float32")
    assert "float32" in smollm2_path(cache, "float32").name
