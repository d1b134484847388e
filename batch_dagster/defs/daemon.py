"""`python -m batch_dagster.defs.daemon SECONDS SOCKET run ...`: the Dagster daemon (`dagster-daemon run ...`, the same
arguments) whose sensor daemon looks for due sensors every SECONDS (serve passes BATCH_SENSOR_LOOP_S, 0.5 s by default)
instead of Dagster's 5 s, so that a small batch created through the API is launched, and shows its end, within about
a second of it (issue #33). Each sensor still runs no more often than its own minimum interval, but for the launch
sensor: told on the Unix socket SOCKET ("": none) that the API created a batch, it ticks at once, and the run it
queues is dequeued at once (#46). Its loops are logged at debug and what happens at info (a batch launched, a status
changed, a webhook sent, a tick that failed), so an operator's log reads as events. serve starts the daemon this way.
"""

from __future__ import annotations

import sys

from batch_dagster.defs.dagster_internals import run_daemon

# The sensor a nudge ticks: the one that launches the API's batches (defs/sensors/api_batches.py).
LAUNCH_SENSOR = "api_batch_sensor"

if __name__ == "__main__":
    run_daemon(sys.argv[3:], float(sys.argv[1]), sys.argv[2] or None, LAUNCH_SENSOR)
