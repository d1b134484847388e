"""Running one benchmark stage as a child process: wall time, peak RSS of its tree, timed log lines."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SAMPLE_S = 0.2
FOLLOW_S = 0.1
Printed = list[tuple[float, str, str]]  # (seconds since launch, line, source), in arrival order


@contextmanager
def work_dir(bench: str) -> Iterator[Path]:
    """A fresh temporary folder for `bench`'s files, removed after it unless BENCH_KEEP_WORK=1."""
    work = Path(tempfile.mkdtemp(prefix=f"batch-dagster-bench-{bench}-"))
    try:
        yield work
    finally:
        if os.environ.get("BENCH_KEEP_WORK") == "1":
            print(f"bench-{bench}: work dir kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def tree_sample(proc: psutil.Process, cpu_by_pid: dict[int, float], peak_by_pid: dict[int, tuple[str, int]]) -> int:
    """RSS of a process and all its descendants, summed (pages shared between them count twice).

    Also records each one's CPU seconds so far in cpu_by_pid (descendants that a killed parent
    leaves behind are never reaped by us, so rusage of children would miss their CPU time) and
    its largest RSS in peak_by_pid.
    """
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            with p.oneshot():
                rss = p.memory_info().rss
                t = p.cpu_times()
                cpu_by_pid[p.pid] = t.user + t.system
                if rss > peak_by_pid.get(p.pid, ("", 0))[1]:
                    peak_by_pid[p.pid] = (_label(p), rss)  # relabelled: vLLM names its processes late
            total += rss
        except psutil.Error:  # exited between listing and reading
            pass
    return total


def _label(p: psutil.Process) -> str:
    """A short name for a process of the tree: vLLM names its engine processes, the rest by command."""
    name = p.name()
    if name.startswith("VLLM::"):
        return name
    cmd = p.cmdline()
    if "-m" in cmd[:-1]:
        return cmd[cmd.index("-m") + 1].rsplit(".", 1)[-1]
    if "multiprocessing" in " ".join(cmd):
        return "mp-child"
    return Path(cmd[1] if len(cmd) > 1 and cmd[0].endswith("python") else cmd[0]).name if cmd else name


def _machine_cpu_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


@dataclass
class Measured:
    """What one stage's process did: its exit code, times and the lines it printed, with arrival times."""

    returncode: int
    wall_s: float
    peak_rss_mb: float
    launched_at: float  # time.time() at launch, to line up with timestamps the process records itself
    # Every line printed, from "out", "err" or a followed file ("file"); vLLM logs to stdout.
    printed: Printed = field(default_factory=list)
    done_at_s: float | None = None  # when `done_when` first held
    hung_at_exit: bool = False  # done, then still running after the grace period: stopped by us
    cpu_s: float = 0.0  # CPU seconds of the process tree (as last sampled, so up to SAMPLE_S short per process)
    other_cpu_pct: float = 0.0  # CPU used by other processes on the machine meanwhile, % of all cores
    peak_rss_by_process_mb: dict[str, float] = field(default_factory=dict)  # "name pid" -> its own peak

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line, source in self.printed if source == "out")

    def first(self, needle: str, after: float = -1.0) -> float | None:
        """Seconds since launch at which the first line containing `needle` arrived (after `after`)."""
        return next((t for t, line, _ in self.printed if t > after and needle in line), None)

    def last(self, needle: str) -> float | None:
        return next((t for t, line, _ in reversed(self.printed) if needle in line), None)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line, _ in self.printed[-n:])


class _Follower(threading.Thread):
    """Tails every file matching a glob as it grows, timing each new line (to within FOLLOW_S)."""

    def __init__(self, pattern: str, emit: Callable[[str, str], None]):
        super().__init__(daemon=True)
        self.pattern, self.emit = pattern, emit
        self.stop = threading.Event()
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}

    def poll(self) -> None:
        for path in sorted(glob.glob(self.pattern)):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            data = self.partial.pop(path, b"") + data
            *complete, rest = data.split(b"\n")
            if rest:
                self.partial[path] = rest
            for raw in complete:
                self.emit(raw.decode(errors="replace"), "file")

    def run(self) -> None:
        while not self.stop.wait(FOLLOW_S):
            self.poll()
        self.poll()


def run_measured(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 7200,
    log_path: Path | None = None,
    follow_glob: str | None = None,
    done_when: Callable[[Printed], bool] | None = None,
    exit_grace_s: float = 60.0,
) -> Measured:
    """Run cmd to the end, sampling the RSS of its process tree every SAMPLE_S seconds.

    stdout and stderr are read line by line as they come (PYTHONUNBUFFERED is set), so each log
    line gets the time it was written within a few milliseconds; files matching `follow_glob`
    (logs a process writes instead of printing them) are tailed the same way. When `done_when`
    holds for the lines so far and the process still runs `exit_grace_s` later, it is stopped and
    the result says `hung_at_exit`.
    """
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    printed: Printed = []
    lock = threading.Lock()
    log = open(log_path, "w") if log_path else None
    cpu_before = _machine_cpu_s()
    cpu_by_pid: dict[int, float] = {}
    peak_by_pid: dict[int, tuple[str, int]] = {}
    launched_at = time.time()
    started = time.perf_counter()

    def emit(line: str, source: str) -> None:
        at = time.perf_counter() - started
        with lock:
            printed.append((at, line, source))
            if log:
                log.write(f"{at:9.3f} {source} {line}\n")

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    ps = psutil.Process(proc.pid)

    def read(stream, source: str) -> None:
        for raw in stream:
            emit(raw.decode(errors="replace").rstrip("\n"), source)

    threads: list[threading.Thread] = [threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
                                       threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True)]
    follower = _Follower(follow_glob, emit) if follow_glob else None
    for t in [*threads, *([follower] if follower else [])]:
        t.start()
    peak = 0
    done_at = None
    hung = False
    try:
        while True:
            peak = max(peak, tree_sample(ps, cpu_by_pid, peak_by_pid))
            try:
                proc.wait(SAMPLE_S)  # returns as soon as the process ends, so wall_s is not rounded up
                break
            except subprocess.TimeoutExpired:
                now = time.perf_counter() - started
                if now > timeout_s:
                    raise TimeoutError(f"{cmd[:3]} ran longer than {timeout_s} s") from None
                if done_when is not None and done_at is None:
                    with lock:
                        if done_when(printed):
                            done_at = now
                if done_at is not None and now - done_at > exit_grace_s:
                    hung = True
                    break
    finally:
        wall = time.perf_counter() - started
        if proc.poll() is None:
            stop_group(proc)
        for t in threads:
            t.join(10)
        if follower:
            follower.stop.set()
            follower.join(10)
        if log:
            log.close()
    other = max(0.0, (_machine_cpu_s() - cpu_before) - sum(cpu_by_pid.values()))
    printed.sort(key=lambda x: x[0])
    return Measured(proc.returncode, wall, peak / 2**20, launched_at, printed, done_at, hung,
                    round(sum(cpu_by_pid.values()), 1), round(100 * other / (wall * (os.cpu_count() or 1)), 1),
                    {f"{name} {pid}": round(rss / 2**20, 1) for pid, (name, rss) in peak_by_pid.items()})


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process group (a stage that overran or hung, a server a bench started): SIGINT, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def stop_service(proc: subprocess.Popen, sig: int = signal.SIGINT, wait_s: float = 90) -> None:
    """Stop a service a bench started as its session's leader (serve, a fleet): `sig` to it, so it stops its own
    children as it does for an operator, then SIGKILL to its process group after `wait_s`, or to what it left."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: it stopped whole
        pass
    proc.wait()


def foreign_engines(own_pid: int | None = None) -> list[str]:
    """vLLM processes on the machine that are not ours: they compete for the same cores."""
    mine = set()
    if own_pid is not None:
        try:
            me = psutil.Process(own_pid)
            mine = {own_pid, *(p.pid for p in me.children(recursive=True))}
        except psutil.Error:
            pass
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.info["pid"] in mine:
            continue
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        if "VLLM::" in text:
            found.append(f"{p.info['pid']} {text.strip()[:60]}")
    return found


def wait_for_quiet(max_wait_s: float, busy_pct: float = 30.0) -> float:
    """Wait (up to max_wait_s) until no other vLLM engine runs and the cores are mostly idle.

    Returns the seconds waited. On a shared machine another engine on the same cores halves a
    stage's speed; the wait and each stage's `other_cpu_pct` make that visible instead of silent.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait_s:
        if not foreign_engines(os.getpid()) and psutil.cpu_percent(interval=2.0) < busy_pct:
            break
        time.sleep(3)
    return round(time.perf_counter() - started, 1)
