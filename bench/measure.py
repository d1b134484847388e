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
    launched_at: float  # time.time() at launch, to line up with timestamps the process records itself
    # (seconds since launch, line, "out" or "err") for every line printed (vLLM logs to stdout).
    printed: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line, stream in self.printed if stream == "out")

    def first(self, needle: str) -> float | None:
        """Seconds since launch at which the first line containing `needle` arrived."""
        return next((t for t, line, _ in self.printed if needle in line), None)

    def last(self, needle: str) -> float | None:
        return next((t for t, line, _ in reversed(self.printed) if needle in line), None)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line, _ in self.printed[-n:])


def run_measured(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
                 timeout_s: float = 7200, log_path: Path | None = None) -> Measured:
    """Run cmd to the end, sampling the RSS of its process tree every SAMPLE_S seconds.

    stdout and stderr are read line by line as they come (PYTHONUNBUFFERED is set), so each log
    line gets the time it was written within a few milliseconds.
    """
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    launched_at = time.time()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    ps = psutil.Process(proc.pid)
    tagged: list[tuple[float, str, str]] = []
    lock = threading.Lock()
    log = open(log_path, "w") if log_path else None

    def read(stream, tag: str) -> None:
        for raw in stream:
            at = time.perf_counter() - started
            line = raw.decode(errors="replace").rstrip("\n")
            with lock:
                tagged.append((at, line, tag))
                if log:
                    log.write(f"{at:9.3f} {tag} {line}\n")

    readers = [threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True)]
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
    tagged.sort(key=lambda x: x[0])
    return Measured(proc.returncode, wall, peak / 2**20, launched_at, tagged)


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
