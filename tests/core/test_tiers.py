"""The core tier stays pure: its tests, and the fixtures every tier loads, import no framework.

(The other tiers' folders and markers are checked when the tests are collected, in tests/conftest.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parent
REPO = CORE.parents[1]
FRAMEWORKS = {"dagster", "dagster_aws", "vllm", "torch", "fastapi", "uvicorn", "sqlalchemy", "openai"}


def test_the_core_tier_imports_no_framework():
    modules = ["tests.conftest", *(f"tests.core.{p.stem}" for p in sorted(CORE.glob("test_*.py")))]
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(FRAMEWORKS)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(modules) > 5 and out.stdout.strip() == "[]", out.stdout
