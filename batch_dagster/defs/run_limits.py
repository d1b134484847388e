"""How the Dagster run queue bounds batch runs: the tags that say what a run needs, and the limits on them.

A run whose model has no server holds a vLLM engine in its own process, so few of them fit on a machine
(one: each engine takes every GPU its process sees). A run whose model is served (a warm fleet, or server mode)
holds no engine: such runs share the model's servers, and only a per-model bound keeps one model's batches from
taking every run slot. The limits are the run queue's `tag_concurrency_limits` (the daemon's
QueuedRunCoordinator): a run waits in the queue, holding nothing, until it fits. A dead run stops counting as
soon as it is marked failed. The order runs launch in is fair queueing's (features/fairness.py, defs/fairness.py).
"""

from __future__ import annotations

from typing import Any

ENGINE_TAG = "batch/engine"
MODEL_TAG = "batch/model"
OFFLINE, SERVER = "offline", "server"
# The run queue's part of dagster.yaml lies between these lines; `batch-dagster instance` writes it from the settings.
BEGIN = "# BEGIN run limits: written by `batch-dagster instance` from BATCH_OFFLINE_RUNS and BATCH_RUNS_PER_MODEL"
END = "# END run limits"


def queue_tags(model: str | None, served: bool) -> dict[str, str]:
    """The run tags the limits count: in-process engine or servers, and the model when it is known."""
    tags = {ENGINE_TAG: SERVER if served else OFFLINE}
    if model:
        tags[MODEL_TAG] = model[:255]
    return tags


def run_limits_yaml(offline_runs: int, runs_per_model: int) -> str:
    """The `concurrency` block of dagster.yaml, between BEGIN and END."""
    for name, value in (("BATCH_OFFLINE_RUNS", offline_runs), ("BATCH_RUNS_PER_MODEL", runs_per_model)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1 (got {value}): below that, those runs would never start")
    return f"""{BEGIN}
concurrency:
  runs:
    tag_concurrency_limits:
      # Runs that hold a vLLM engine in their own process (each takes every GPU its process sees).
      - key: {ENGINE_TAG}
        value: {OFFLINE}
        limit: {offline_runs}
      # Runs of one model at once, whoever serves it: batches share a fleet up to this many.
      - key: {MODEL_TAG}
        value:
          applyLimitPerUniqueValue: true
        limit: {runs_per_model}
{END}
"""


def model_run_limit(instance: Any) -> int | None:
    """The runs of one model the instance's run queue lets run at once (its limit on MODEL_TAG); None without one.

    The queue's own number, from its dagster.yaml (written by `batch-dagster instance`, or by a Helm chart's values),
    not the settings of the process that asks."""
    queue = instance.get_concurrency_config().run_queue_config
    for limit in queue.tag_concurrency_limits if queue is not None else ():
        if limit.get("key") == MODEL_TAG:
            return int(limit["limit"])
    return None


def with_run_limits(config: str, offline_runs: int, runs_per_model: int) -> str:
    """`config` (a dagster.yaml's text) with its run limits block replaced by one with these limits."""
    head, begin, rest = config.partition(BEGIN)
    _, end, tail = rest.partition(END + "\n")
    if not (begin and end):
        raise ValueError(f"the dagster.yaml has no run limits block (from {BEGIN!r} to {END!r})")
    return head + run_limits_yaml(offline_runs, runs_per_model) + tail
