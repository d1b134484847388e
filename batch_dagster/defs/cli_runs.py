"""Runs that a `batch-dagster run` process executes itself: the tag naming that process, and whether it is gone.

Such a run starts in the CLI's own process (`execute_in_process`, no launcher), so Dagster's run monitoring cannot
tell that the process died (the default launcher does not check run workers). A run whose CLI process was killed
would stay STARTED, holding its run-queue slot, for ever: the status sensor and the next CLI start mark it failed.
"""

from __future__ import annotations

import socket

import dagster as dg

CLI_PROCESS_TAG = "batch/cli_process"  # "host:pid:start time" of the process running the run
CLI_GONE = "The `batch-dagster run` process that ran it is gone (killed while it ran)."


def process_label(pid: int) -> str | None:
    """The CLI_PROCESS_TAG value of the process `pid` of this machine; None when there is no such process."""
    import psutil

    try:
        return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time()}"
    except psutil.NoSuchProcess:
        return None


def cli_process_gone(run: dg.DagsterRun) -> bool:
    """Whether an unfinished run was started by a `batch-dagster run` process of this machine that is gone."""
    label = run.tags.get(CLI_PROCESS_TAG)
    if not label or run.status not in (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED):
        return False
    host, pid, _ = label.rsplit(":", 2)
    # Another machine's process cannot be seen from here; a pid reused since has another start time.
    return host == socket.gethostname() and pid.isdigit() and process_label(int(pid)) != label


def fail_runs_of_gone_cli_processes(instance: dg.DagsterInstance) -> list[str]:
    """Mark failed the runs whose `batch-dagster run` process is gone (at the next CLI start); their run ids."""
    failed = []
    for run in instance.get_runs(dg.RunsFilter(job_name="batch_job", statuses=[dg.DagsterRunStatus.STARTING,
                                                                               dg.DagsterRunStatus.STARTED])):
        if cli_process_gone(run):
            instance.report_run_failed(run, CLI_GONE)
            failed.append(run.run_id)
    return failed
