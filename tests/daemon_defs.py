"""Definitions for tests that run the real Dagster daemon: the project's pipeline and API sensors on a fake engine.

The engine runs in the daemon's run processes, so what a test needs to see crosses processes through
files: every engine call is appended to $BATCH_TEST_CALLS, and the $BATCH_TEST_KILL_ON_CALL-th call of a
process kills that process with SIGKILL, as the OOM killer or a crash would; each call takes
$BATCH_TEST_CALL_S seconds, and a call whose custom_ids start with the name of a file in the folder
$BATCH_TEST_HOLD waits until that file is gone (a test holds a batch's run so for as long as it needs, up to
10 minutes). Runs use the in-process executor: the process that dies is then the run worker itself, and the
tests stay quick. A model with a fleet ($BATCH_FLEET_URLS) runs on that fleet for real.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import dagster as dg

from batch_dagster.defs.assets.batch import lifecycle
from batch_dagster.defs.assets.checks import lifecycle_checks
from batch_dagster.defs.jobs import batch_job
from batch_dagster.defs.resources import VLLMResource
from batch_dagster.defs.resources.from_env import resources_from_env
from batch_dagster.defs.retention import history_retention_sensor
from batch_dagster.defs.sensors import api_batch_sensor, api_batch_status_sensor
from batch_dagster.settings import Settings
from tests.helpers import FakeEngine, FakeVLLM

_calls_in_this_process = 0


class LoggedEngine(FakeEngine):
    """The fake engine, logging each call to a file; the process dies at its $BATCH_TEST_KILL_ON_CALL-th call."""

    def run(self, endpoint, requests, on_progress=None):
        global _calls_in_this_process
        _calls_in_this_process += 1
        killed = _calls_in_this_process == int(os.environ.get("BATCH_TEST_KILL_ON_CALL") or 0)
        call = {"pid": os.getpid(), "custom_ids": [cid for cid, _ in requests], "killed": killed}
        with open(os.environ["BATCH_TEST_CALLS"], "a") as f:
            f.write(json.dumps(call) + "\n")
        if killed:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(os.environ.get("BATCH_TEST_CALL_S") or 0))
        if hold := os.environ.get("BATCH_TEST_HOLD"):
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and any(
                    cid.startswith(held.name) for held in Path(hold).iterdir() for cid, _ in requests):
                time.sleep(0.2)
        return super().run(endpoint, requests, on_progress)


class LoggedVLLM(FakeVLLM):
    def engine(self, model: str) -> Any:
        if self.server_urls_for(model) is not None:
            return VLLMResource.engine(self, model)
        self.spec(model)
        return LoggedEngine()


def engine_calls(path) -> list[dict]:
    """The calls a LoggedEngine logged to `path`, in order."""
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


@dg.definitions
def defs() -> dg.Definitions:
    """Built when the daemon loads them, from its environment (as the project's are)."""
    settings = Settings.from_env()
    return dg.Definitions(
        assets=lifecycle(settings.step_retry_delay_s),
        asset_checks=lifecycle_checks,
        jobs=[batch_job],
        sensors=[api_batch_sensor, api_batch_status_sensor, history_retention_sensor],  # as the project's serve runs
        resources={
            **resources_from_env(settings),
            "vllm": LoggedVLLM(models_file=str(settings.models_file), model_cache_dir="/nonexistent",
                               fleet_urls=dict(settings.fleet_urls)),
        },
        executor=dg.in_process_executor,
    )
