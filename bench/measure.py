"""Running one benchmark stage as a child process: wall time, peak RSS of its tree, timed log lines."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SAMPLE_S = 0.2


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and all its descendants, summed (pages shared between them count twice)."""
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # exited between listing and reading
            pass
    return total


@dataclass
class Measured:
    """What one stage's process did: its exit code, times and the lines it printed, with arrival times."""

    returncode: int
    wall_s: float
    peak_rss_mb: float
    stdout: str
    # (seconds since launch, line) for every stderr line, in order: log lines timed as they arrive.
    stderr_lines: list[tuple[float, str]] = field(default_factory=list)

    def first(self, needle: str) -> float | None:
        """Seconds since launch at which the first stderr line containing `needle` arrived."""
        return next((t for t, line in self.stderr_lines if needle in line), None)

    def last(self, needle: str) -> float | None:
        return next((t for t, line in reversed(self.stderr_lines) if needle in line), None)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.stderr_lines[-n:])


def run_measured(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
                 timeout_s: float = 7200, log_path: Path | None = None) -> Measured:
    """Run cmd to the end, sampling the RSS of its process tree every SAMPLE_S seconds.

    stderr is read line by line as it comes (PYTHONUNBUFFERED is set), so each log line gets the
    time it was written to within a few milliseconds; stdout is kept whole.
    """
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    ps = psutil.Process(proc.pid)
    lines: list[tuple[float, str]] = []
    out_chunks: list[bytes] = []
    log = open(log_path, "w") if log_path else None

    def read_err() -> None:
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append((time.perf_counter() - started, line))
            if log:
                log.write(f"{lines[-1][0]:9.3f} {line}\n")

    def read_out() -> None:
        out_chunks.append(proc.stdout.read())

    readers = [threading.Thread(target=read_err, daemon=True), threading.Thread(target=read_out, daemon=True)]
    for r in readers:
        r.start()
    peak = 0
    try:
        while True:
            peak = max(peak, tree_rss(ps))
            try:
                proc.wait(SAMPLE_S)  # returns as soon as the process ends, so wall_s is not rounded up
                break
            except subprocess.TimeoutExpired:
                if time.perf_counter() - started > timeout_s:
                    raise TimeoutError(f"{cmd[:3]} ran longer than {timeout_s} s") from None
    finally:
        wall = time.perf_counter() - started
        if proc.poll() is None:
            _stop_group(proc)
        for r in readers:
            r.join(10)
        if log:
            log.close()
    return Measured(proc.returncode, wall, peak / 2**20, b"".join(out_chunks).decode(errors="replace"), lines)


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop a stage that overran: SIGINT to its process group, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
