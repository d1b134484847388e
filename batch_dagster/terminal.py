"""Keeping a person's terminal for what matters: the progress bar and the summary.

vLLM, torch and Dagster write start-up warnings, tracebacks and shutdown notices to file
descriptors 1 and 2, some of them from vLLM's engine core, a spawned child process that inherits
those descriptors. Python-level redirection cannot catch those, so the descriptors themselves are
pointed at a log file while a batch runs; the progress bar writes to a saved copy of the terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def output_to_log(log_file: Path) -> Iterator[TextIO]:
    """Send everything written to fds 1 and 2 (this process and its children) to `log_file`; yield the terminal.

    The yielded stream is the original stderr, for the progress bar. Both fds are restored on exit.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved_err), "w", buffering=1)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    # Python's own streams too: they need not be fds 1 and 2 (a test runner's capture, an IDE).
    py_out, py_err = sys.stdout, sys.stderr
    log = open(log_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = log
        yield terminal
    finally:
        sys.stdout, sys.stderr = py_out, py_err
        log.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for d in (fd, saved_out, saved_err):
            os.close(d)
        terminal.close()
