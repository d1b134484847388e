"""The project's Dagster instance: DAGSTER_HOME with the repo's dagster.yaml, shared by CLI and UI.

Without DAGSTER_PG_URL, DAGSTER_HOME/dagster.yaml links to the repo's dagster.yaml (storage: SQLite files under
DAGSTER_HOME). With DAGSTER_PG_URL set, it is written as the repo's dagster.yaml plus dagster-postgres' storage block
(runs, event logs, schedules), which names the variable, not its value: Dagster reads the URL at start-up, so the
password never lands on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from batch_dagster.settings import PACKAGE_DIR

REPO_INSTANCE_CONFIG = PACKAGE_DIR.parent / "dagster.yaml"
# Not a BATCH_* variable: Dagster itself reads it, through the `env:` reference in the storage block.
PG_URL_VARIABLE = "DAGSTER_PG_URL"
# The first line of a dagster.yaml this module wrote; only such a file (or the link) is ever replaced.
WRITTEN_MARK = "# Written by `batch-dagster instance`"
POSTGRES_STORAGE = f"""
# Run, event-log and schedule storage on Postgres (dagster-postgres), because {PG_URL_VARIABLE} is set.
storage:
  postgres:
    postgres_url:
      env: {PG_URL_VARIABLE}
"""


def pg_url_problem(url: str) -> str | None:
    """Why DAGSTER_PG_URL cannot work, or None.

    dagster-postgres 0.29 speaks psycopg2, but SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, on which
    its run-event NOTIFY fails: the URL must name the driver.
    """
    scheme = url.split("://", 1)[0]
    if scheme != "postgresql+psycopg2":
        return (f"{PG_URL_VARIABLE} must start with postgresql+psycopg2:// (got {scheme}://): dagster-postgres uses "
                "psycopg2, and SQLAlchemy 2.1 maps other postgresql schemes to psycopg 3")
    return None


def instance_config(postgres: bool) -> str:
    """The text of DAGSTER_HOME/dagster.yaml: the repo's, plus the Postgres storage block when `postgres`."""
    base = REPO_INSTANCE_CONFIG.read_text()
    if not postgres:
        return base
    header = f"{WRITTEN_MARK} from {REPO_INSTANCE_CONFIG.name} because {PG_URL_VARIABLE} is set. Do not edit.\n"
    return header + base.rstrip("\n") + "\n" + POSTGRES_STORAGE


def ensure_dagster_home() -> Path:
    """Set DAGSTER_HOME (default ./.dagster_home) and give it this project's dagster.yaml.

    A dagster.yaml the user wrote is left alone; the link or a file written here follows DAGSTER_PG_URL.
    """
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / ".dagster_home").resolve()
    os.environ["DAGSTER_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not REPO_INSTANCE_CONFIG.exists():
        return home
    ours = config.is_symlink() or (config.exists() and config.read_text().startswith(WRITTEN_MARK))
    if config.exists() and not ours:
        return home
    if os.environ.get(PG_URL_VARIABLE):
        text = instance_config(postgres=True)
        if config.is_symlink() or not config.exists() or config.read_text() != text:
            config.unlink(missing_ok=True)
            tmp = config.with_suffix(".yaml.tmp")
            tmp.write_text(text)
            tmp.replace(config)
    elif not config.is_symlink():
        config.unlink(missing_ok=True)
        config.symlink_to(REPO_INSTANCE_CONFIG)
    return home
