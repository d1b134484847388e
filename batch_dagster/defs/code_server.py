"""`python -m batch_dagster.defs.code_server api grpc ...`: Dagster's code server (`dagster api grpc ...`, the same
arguments) whose runs start in processes forked from a warm one that has imported Dagster and the project, not in new
interpreters. The daemon that serve starts runs its code servers this way (batch_dagster/defs/daemon.py).
"""

from __future__ import annotations

import sys

from batch_dagster.defs.dagster_internals import run_code_server

if __name__ == "__main__":
    run_code_server(sys.argv[1:])
