"""A run worker is forked from a forkserver that has imported RUN_WORKER_PRELOAD (defs/dagster_internals.py
`run_code_server`): what a batch's steps import is there before its run, and frozen out of the child's garbage
collections (defs/gc_frozen.py)."""

from __future__ import annotations

import gc
import multiprocessing
import sys

from batch_dagster.defs.dagster_internals import RUN_WORKER_PRELOAD


def _what_the_child_holds(queue) -> None:
    queue.put((sorted(m for m in ("pandas", "pyarrow.dataset", "httpx", "batch_dagster.definitions")
                      if m in sys.modules), gc.get_freeze_count()))


def test_a_run_worker_starts_with_the_steps_imports_frozen():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RUN_WORKER_PRELOAD)
    queue = context.Queue()
    child = context.Process(target=_what_the_child_holds, args=(queue,))
    child.start()
    try:
        modules, frozen = queue.get(timeout=120)
    finally:
        child.join(30)
    assert modules == ["batch_dagster.definitions", "httpx", "pandas", "pyarrow.dataset"]
    assert frozen > 100_000  # Dagster's, the project's and pandas' objects: a collection in the child skips them
