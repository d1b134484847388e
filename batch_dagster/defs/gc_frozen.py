"""Imported last by the forkserver that run workers are forked from (dagster_internals.RUN_WORKER_PRELOAD): what it
imported before goes to the garbage collector's permanent generation (gc.freeze), so that no run worker's collections
walk it. Walking it would write to, and so copy, the memory each run worker shares with the forkserver."""

import gc

gc.freeze()
