"""The run limits as Dagster reads them from the instance `batch-dagster instance` prepares, and a CLI run's tags.
(The sensors' tags: tests/api/test_sensors.py. Two fleet batches side by side while two offline ones wait for each
other, under the real daemon: tests/system/test_run_queue.py.)"""

from __future__ import annotations

import os

import dagster as dg
import pytest

from batch_dagster.defs.instance import ensure_dagster_home
from batch_dagster.defs.run_limits import model_run_limit
from batch_dagster.defs.runner import run_batch
from batch_dagster.settings import Settings
from tests.helpers import CHAT_MODEL, FAKES, FakeEngine, FakeVLLM, chat_request, make_defs, write_jsonl


@pytest.mark.parametrize("settings, limits", [
    ({}, (1, 4)),  # the link to the package's dagster.yaml
    ({"BATCH_OFFLINE_RUNS": "2", "BATCH_RUNS_PER_MODEL": "6"}, (2, 6)),  # a file written from the settings
])
def test_dagster_reads_the_run_limits_of_the_settings(tmp_path, monkeypatch, settings, limits):
    for name in ("DAGSTER_PG_URL", "BATCH_OFFLINE_RUNS", "BATCH_RUNS_PER_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home(Settings.from_env())
    offline, per_model = limits
    with dg.DagsterInstance.from_config(str(home)) as instance:
        concurrency = instance.get_concurrency_config()
        assert model_run_limit(instance) == per_model  # what the queue ETA sensor counts as the model's slots
    assert concurrency.run_queue_config is not None
    assert concurrency.run_queue_config.tag_concurrency_limits == [
        {"key": "batch/engine", "value": "offline", "limit": offline},
        {"key": "batch/model", "value": {"applyLimitPerUniqueValue": True}, "limit": per_model},
    ]
    assert concurrency.pool_config.default_pool_limit is None  # no pool: no step waits for a slot


def test_a_cli_run_carries_the_queue_tags_it_counts_by(tmp_path, data_dir, instance):
    # `batch-dagster run` does not wait in the queue, but while it runs the queue counts it by these tags.
    FAKES["cli-queue"] = FakeEngine()
    for fleet_url, engine in (("http://127.0.0.1:9", "server"), ("", "offline")):
        vllm = FakeVLLM(models_file=str(Settings.from_env().models_file), model_cache_dir="/nonexistent",
                        fake="cli-queue", fleet_urls={CHAT_MODEL: fleet_url} if fleet_url else {})
        summary = run_batch(write_jsonl(tmp_path / "in.jsonl", [chat_request("a", "hi")]), tmp_path / engine,
                            show_progress=False, defs=make_defs(data_dir, vllm), instance=instance).to_dict()
        run = instance.get_run_by_id(summary["run_id"])
        assert run is not None and summary["status"] == "completed"
        assert {k: v for k, v in run.tags.items() if k in ("batch/engine", "batch/model")} == {
            "batch/engine": engine, "batch/model": CHAT_MODEL}
        assert run.tags["batch/cli_process"].split(":")[1] == str(os.getpid())  # the process a later start checks
