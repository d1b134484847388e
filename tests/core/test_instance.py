"""`batch-dagster instance`: DAGSTER_HOME's dagster.yaml follows DAGSTER_PG_URL (Postgres storage or the package's link)
and BATCH_STORAGE_URL (compute logs on S3), and the run limits' settings (BATCH_OFFLINE_RUNS, BATCH_RUNS_PER_MODEL)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batch_dagster import settings
from batch_dagster.defs.instance import INSTANCE_CONFIG, ensure_dagster_home
from batch_dagster.defs.run_limits import run_limits_yaml

CLI = Path(sys.executable).with_name("batch-dagster")
LIMIT_VARIABLES = ("BATCH_OFFLINE_RUNS", "BATCH_RUNS_PER_MODEL")


def instance(home: Path, pg_url: str | None, check: bool = True, storage_url: str = "",
             **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_PG_URL", "BATCH_STORAGE_URL", *LIMIT_VARIABLES)}
    env |= {"DAGSTER_HOME": str(home), "BATCH_STORAGE_URL": storage_url} | settings
    if pg_url:
        env["DAGSTER_PG_URL"] = pg_url
    return subprocess.run([str(CLI), "instance"], env=env, capture_output=True, text=True, check=check)


def run_limits(config: Path) -> dict[str, object]:
    """The run queue's tag limits of a dagster.yaml, by tag key."""
    limits = yaml.safe_load(config.read_text())["concurrency"]["runs"]["tag_concurrency_limits"]
    return {limit["key"]: (limit["value"], limit["limit"]) for limit in limits}


def test_instance_follows_dagster_pg_url(tmp_path):
    home, url = tmp_path / "home", "postgresql+psycopg2://u:secret@db.example:5432/dagster"
    assert "storage=sqlite" in instance(home, None).stdout
    assert (home / "dagster.yaml").resolve() == INSTANCE_CONFIG.resolve()

    assert "storage=postgres" in instance(home, url).stdout
    config = home / "dagster.yaml"
    text = config.read_text()
    assert not config.is_symlink() and INSTANCE_CONFIG.read_text().strip() in text
    assert "postgres:\n    postgres_url:\n      env: DAGSTER_PG_URL" in text
    assert "secret" not in text  # Dagster reads the URL from the environment at start-up

    assert "storage=sqlite" in instance(home, None).stdout
    assert (home / "dagster.yaml").resolve() == INSTANCE_CONFIG.resolve()


def test_instance_puts_compute_logs_beside_batch_folders_on_s3(tmp_path):
    home = tmp_path / "home"
    assert "compute_logs=s3://batches/team-a/dagster-compute-logs" in instance(
        home, None, storage_url="s3://batches/team-a/").stdout
    config = home / "dagster.yaml"
    text = config.read_text()
    assert not config.is_symlink() and "storage:" not in text
    assert ("class: S3ComputeLogManager\n  config:\n    bucket: batches\n    prefix: team-a/dagster-compute-logs\n"
            in text)

    both = instance(home, "postgresql+psycopg2://u@db.example/dagster", storage_url="s3://batches").stdout
    assert "storage=postgres" in both and "compute_logs=s3://batches/dagster-compute-logs" in both
    text = config.read_text()
    assert "env: DAGSTER_PG_URL" in text and "    bucket: batches\n    prefix: dagster-compute-logs\n" in text

    # Batch folders on local disk: Dagster's own compute logs, and the link back.
    assert "compute_logs" not in instance(home, None, storage_url=str(tmp_path / "data")).stdout
    assert config.resolve() == INSTANCE_CONFIG.resolve()


def test_instance_leaves_a_users_own_config_alone(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    instance(home, "postgresql+psycopg2://u@db.example/dagster")
    assert (home / "dagster.yaml").read_text() == "telemetry:\n  enabled: false\n"


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@db.example/dagster", "mysql://u@db.example/dagster",
                                 "u:secret@db.example/dagster"])
def test_instance_refuses_a_url_of_another_driver_or_scheme(tmp_path, url):
    done = instance(tmp_path / "home", url, check=False)
    assert done.returncode == 2
    assert "DAGSTER_PG_URL must start with postgresql://, postgres:// or postgresql+psycopg2://" in done.stderr
    assert "Traceback" not in done.stderr and "secret" not in done.stderr
    assert not (tmp_path / "home" / "dagster.yaml").exists()


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "postgresql+psycopg2"])
def test_the_url_in_the_form_dagsters_docs_use_is_exported_with_the_driver(tmp_path, monkeypatch, scheme):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_PG_URL", f"{scheme}://u:secret@db.example:5432/dagster")
    ensure_dagster_home(settings.Settings.from_env())
    # For this process and every one it starts; the file still names the variable only.
    assert os.environ["DAGSTER_PG_URL"] == "postgresql+psycopg2://u:secret@db.example:5432/dagster"
    text = (tmp_path / "home" / "dagster.yaml").read_text()
    assert "env: DAGSTER_PG_URL" in text and "secret" not in text
    assert "storage=postgres" in instance(tmp_path / "cli", f"{scheme}://u@db.example/dagster").stdout


def test_make_dev_runs_dagster_with_the_exported_url(tmp_path):
    env = {**os.environ, "DAGSTER_PG_URL": "postgres://u@db.example/dagster"}
    show = [sys.executable, "-c", "import os; print(os.environ['DAGSTER_PG_URL'])"]
    done = subprocess.run([sys.executable, "-m", "batch_dagster.defs.instance", *show], env=env,
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "postgresql+psycopg2://u@db.example/dagster"
    env["DAGSTER_PG_URL"] = "sqlite:///x.db"
    refused = subprocess.run([sys.executable, "-m", "batch_dagster.defs.instance", *show], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 1 and "must start with postgresql://" in refused.stderr and not refused.stdout


def test_run_refuses_another_scheme_before_a_run_starts(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_PG_URL": "mysql://u@db.example/d",
           "BATCH_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run([str(CLI), "run", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "DAGSTER_PG_URL must start with postgresql://" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "home").exists()


def test_the_repos_dagster_yaml_holds_the_default_run_limits():
    # So the link is right when no setting changes them: offline runs one at a time, 4 runs per model.
    text = INSTANCE_CONFIG.read_text()
    assert run_limits_yaml(settings.DEFAULT_OFFLINE_RUNS, settings.DEFAULT_RUNS_PER_MODEL) in text
    assert run_limits(INSTANCE_CONFIG) == {"batch/engine": ("offline", 1),
                                                "batch/model": ({"applyLimitPerUniqueValue": True}, 4)}
    assert "pools" not in yaml.safe_load(text)["concurrency"]  # no step waits for a pool slot


def test_instance_writes_the_run_limits_of_the_settings(tmp_path):
    home = tmp_path / "home"
    config = home / "dagster.yaml"
    instance(home, None, BATCH_OFFLINE_RUNS="2", BATCH_RUNS_PER_MODEL="8")
    assert not config.is_symlink()
    assert run_limits(config) == {"batch/engine": ("offline", 2),
                                  "batch/model": ({"applyLimitPerUniqueValue": True}, 8)}
    # The rest is the package's file, unchanged.
    other = {k: v for k, v in yaml.safe_load(config.read_text()).items() if k != "concurrency"}
    assert other == {k: v for k, v in yaml.safe_load(INSTANCE_CONFIG.read_text()).items() if k != "concurrency"}

    instance(home, "postgresql+psycopg2://u@db.example/dagster", BATCH_RUNS_PER_MODEL="3")
    assert run_limits(config)["batch/model"][1] == 3 and "postgres" in yaml.safe_load(config.read_text())["storage"]

    instance(home, None, BATCH_OFFLINE_RUNS="1")  # the defaults again: the link
    assert config.is_symlink() and config.resolve() == INSTANCE_CONFIG.resolve()


def test_instance_refuses_a_limit_below_one(tmp_path):
    done = instance(tmp_path / "home", None, check=False, BATCH_OFFLINE_RUNS="0")
    assert done.returncode == 2
    assert "BATCH_OFFLINE_RUNS must be at least 1" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "home" / "dagster.yaml").exists()


def test_the_instance_config_is_package_data_so_a_wheel_keeps_the_run_limits_and_retries():
    """An install that is not editable has no repository: what batch-dagster instance links must ship in the wheel."""
    import fnmatch
    import tomllib

    package = settings.PACKAGE_DIR
    assert INSTANCE_CONFIG.is_relative_to(package)
    patterns = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(str(INSTANCE_CONFIG.relative_to(package)), p) for p in patterns["batch_dagster"])
    config = yaml.safe_load(INSTANCE_CONFIG.read_text())
    assert config["run_retries"]["enabled"] and config["concurrency"]["runs"]["tag_concurrency_limits"]


def test_a_link_to_where_the_config_was_is_made_again(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").symlink_to(tmp_path / "gone" / "dagster.yaml")  # the repository's old place
    instance(home, None)
    assert (home / "dagster.yaml").resolve() == INSTANCE_CONFIG.resolve()
