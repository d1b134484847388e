"""The project's Dagster instance: DAGSTER_HOME with the package's dagster.yaml, shared by CLI and UI.

DAGSTER_HOME/dagster.yaml links to batch_dagster/config/dagster.yaml (storage: SQLite files under DAGSTER_HOME),
installed with the package, so that an install from a wheel keeps the run limits and retries. Unless the
settings make it differ; then it is written. BATCH_OFFLINE_RUNS and BATCH_RUNS_PER_MODEL replace the run queue's
limits (batch_dagster/defs/run_limits.py). With DAGSTER_PG_URL set, dagster-postgres' storage block (runs, event logs,
schedules) is added, which names the variable, not its value: Dagster reads the URL at start-up, so the password
never lands on disk. With batch folders on S3 (BATCH_STORAGE_URL), step and sensor logs go to S3 too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from batch_dagster.defs.run_limits import with_run_limits
from batch_dagster.settings import CONFIG_DIR, DEFAULT_OFFLINE_RUNS, DEFAULT_RUNS_PER_MODEL, Settings

INSTANCE_CONFIG = CONFIG_DIR / "dagster.yaml"
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
# Beside the batch folders, under the storage's prefix.
COMPUTE_LOGS_FOLDER = "dagster-compute-logs"
S3_COMPUTE_LOGS = """
# Step and sensor logs on S3 beside the batch folders, because BATCH_STORAGE_URL is on S3: every host
# writes them to one place, for the UI (endpoint and credentials: boto3's own AWS_* variables).
compute_logs:
  module: dagster_aws.s3.compute_log_manager
  class: S3ComputeLogManager
  config:
    bucket: {bucket}
    prefix: {prefix}
    # A run worker killed mid-step never finishes its capture: what it logged up to the last upload is kept.
    upload_interval: 10
"""


PG_DRIVER_SCHEME = "postgresql+psycopg2"
# The forms Dagster's docs (and libpq) write, for the one driver dagster-postgres 0.29 speaks.
_PG_SCHEMES = {"postgresql": PG_DRIVER_SCHEME, "postgres": PG_DRIVER_SCHEME, PG_DRIVER_SCHEME: PG_DRIVER_SCHEME}


def pg_url_problem(url: str) -> str | None:
    """Why DAGSTER_PG_URL (`url`, empty when unset) cannot work, or None.

    dagster-postgres 0.29 speaks psycopg2, but SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, on which
    its run-event NOTIFY fails ("syntax error at or near $1"): export_pg_url names the driver for it.
    """
    scheme = url.split("://", 1)[0] if "://" in url else None  # never the URL itself: it may hold a password
    if url and scheme not in _PG_SCHEMES:
        return (f"{PG_URL_VARIABLE} must start with postgresql://, postgres:// or {PG_DRIVER_SCHEME}:// "
                f"(got {f'{scheme[:32]}://' if scheme else 'no scheme'}): dagster-postgres uses psycopg2")
    return None


def export_pg_url() -> bool:
    """Put DAGSTER_PG_URL in the environment in the form dagster-postgres needs (postgresql:// and postgres://
    become postgresql+psycopg2://), for this process and every process it starts; False when it is unset.

    The dagster.yaml written here reads the variable (`env:`), so the URL and its password stay off the disk; every
    entry point (run, instance, serve, `make dev` through this module's __main__) calls this before Dagster starts.
    Raises ValueError with pg_url_problem's message for a URL that cannot work.
    """
    url = os.environ.get(PG_URL_VARIABLE, "")
    if problem := pg_url_problem(url):
        raise ValueError(problem)
    if not url:
        return False
    scheme, rest = url.split("://", 1)
    os.environ[PG_URL_VARIABLE] = f"{_PG_SCHEMES[scheme]}://{rest}"
    return True


def compute_logs_place(storage_url: str) -> tuple[str, str] | None:
    """The bucket and prefix of step and sensor logs when batch folders are on S3 (`storage_url`), else None.

    A run worker writes its steps' logs where the instance that launched it says. With Dagster's default (files
    under DAGSTER_HOME) that is a folder of the daemon's host, which the UI on another host never sees. The staging
    folder is left to Dagster's default (/tmp of each process): a path written here would be this host's.
    """
    url = urlparse(storage_url)
    if url.scheme != "s3":
        return None
    return url.netloc, "/".join(part for part in (url.path.strip("/"), COMPUTE_LOGS_FOLDER) if part)


def instance_config(postgres: bool, storage_url: str = "", offline_runs: int = DEFAULT_OFFLINE_RUNS,
                    runs_per_model: int = DEFAULT_RUNS_PER_MODEL) -> str:
    """The text of DAGSTER_HOME/dagster.yaml: the package's with these run limits, plus the Postgres storage block when
    `postgres` and the S3 compute log block when `storage_url` is on S3. Exactly the package's text when that changes
    nothing (then DAGSTER_HOME links to it)."""
    base = INSTANCE_CONFIG.read_text()
    text = with_run_limits(base, offline_runs, runs_per_model)
    logs = compute_logs_place(storage_url)
    if not postgres and logs is None and text == base:
        return base
    because = ", ".join(name for name, on in ((PG_URL_VARIABLE, postgres), ("BATCH_STORAGE_URL", logs),
                                              ("BATCH_OFFLINE_RUNS / BATCH_RUNS_PER_MODEL", text != base)) if on)
    header = f"{WRITTEN_MARK} from {INSTANCE_CONFIG.name} because of {because}. Do not edit.\n"
    blocks = (POSTGRES_STORAGE if postgres else "") + (S3_COMPUTE_LOGS.format(bucket=logs[0], prefix=logs[1])
                                                         if logs else "")
    return header + text.rstrip("\n") + "\n" + blocks


def ensure_dagster_home(settings: Settings) -> Path:
    """Set DAGSTER_HOME (default ./.dagster_home) and give it this project's dagster.yaml.

    A dagster.yaml the user wrote is left alone; the link or a file written here follows DAGSTER_PG_URL,
    BATCH_STORAGE_URL and the run limits' settings (`settings`). Raises ValueError
    for a DAGSTER_PG_URL that cannot work (before anything is written) or a run limit below 1.
    """
    postgres = export_pg_url()
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / ".dagster_home").resolve()
    os.environ["DAGSTER_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    ours = config.is_symlink() or (config.exists() and config.read_text().startswith(WRITTEN_MARK))
    if config.exists() and not ours:
        return home
    text = instance_config(postgres, settings.storage_url, settings.offline_runs,
                           settings.runs_per_model)
    if text != INSTANCE_CONFIG.read_text():
        if config.is_symlink() or not config.exists() or config.read_text() != text:
            config.unlink(missing_ok=True)
            tmp = config.with_suffix(".yaml.tmp")
            tmp.write_text(text)
            tmp.replace(config)
    elif not config.is_symlink() or config.resolve() != INSTANCE_CONFIG.resolve():  # a link to where it was
        config.unlink(missing_ok=True)
        config.symlink_to(INSTANCE_CONFIG)
    return home


if __name__ == "__main__":
    # `make dev`: `python -m batch_dagster.defs.instance dagster dev ...` runs the command (the UI and the daemon)
    # with DAGSTER_PG_URL as export_pg_url makes it.
    try:
        export_pg_url()
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    os.execvp(sys.argv[1], sys.argv[1:])
