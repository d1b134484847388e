"""The project's Dagster instance: DAGSTER_HOME with the repo's dagster.yaml, shared by CLI and UI."""

from __future__ import annotations

import os
from pathlib import Path

from batch_dagster.settings import PACKAGE_DIR

REPO_INSTANCE_CONFIG = PACKAGE_DIR.parent / "dagster.yaml"


def ensure_dagster_home() -> Path:
    """Set DAGSTER_HOME (default ./.dagster_home) and link the repo's dagster.yaml into it."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / ".dagster_home").resolve()
    os.environ["DAGSTER_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists() and REPO_INSTANCE_CONFIG.exists():
        config.symlink_to(REPO_INSTANCE_CONFIG)
    return home
