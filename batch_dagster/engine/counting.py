"""Where a generation model's bodies are rendered to be counted: a count worker, or the model's own servers.

A count worker is a child process (engine/render.py) holding vLLM's renderer, started on the first count in a process
and kept for the next ones: vLLM's import (torch with it, several seconds) is paid once per process, never in the one
that asks, and a body that renders past its deadline is stopped by killing the worker (a new one starts on the next
ask). A model with a fleet or servers already holds vLLM's renderer warm in each replica: its bodies go to their
`/render` routes (vLLM's render server API), each with its deadline, and to a worker only when no replica has them.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import orjson

from . import orphans
from .lines import vllm_body
from .server import healthy_workers
from .tokens import CountFailed, TimedCount, TimedOut, without_images

log = logging.getLogger(__name__)

# What a worker renders with, as `module:factory` (engine/render.py's Renderer); the tests name a word renderer.
FACTORY = "batch_dagster.engine.render:vllm_renderer"
# A worker's start (vLLM's import) and a model's first load, on a loaded machine: not a body's to pay.
START_TIMEOUT_S = 300.0


class _Gone(Exception):
    """The worker process ended (or its pipes broke) before it answered."""


class CountWorker:
    """One count worker process, asked one body at a time (a lock: each ask is short, or stopped at its deadline)."""

    def __init__(self, models_file: str, model_cache_dir: str, factory: str):
        # -P: the worker imports what this process imports (its sys.path, as PYTHONPATH), never a package of the same
        # name in its working folder.
        self.command = [sys.executable, "-P", "-m", "batch_dagster.engine.render", models_file, model_cache_dir,
                        factory]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._watcher: subprocess.Popen[bytes] | None = None
        self._pending = b""
        self._context: dict[str, int] = {}  # the models loaded in this process, and their context length

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def context_length(self, model: str) -> int:
        """Make the worker ready for `model` (started, the model's renderer loaded); the model's context length."""
        with self._lock:
            return self._loaded(model)

    def count(self, model: str, endpoint: str, body: dict[str, Any], timeout_s: float) -> list[int] | None:
        """Each prompt's tokens as vLLM renders the body; None when vLLM refuses it; TimedOut past `timeout_s`
        (the worker is killed: its render may still be running)."""
        with self._lock:
            for attempt in (1, 2):  # a worker that died (killed, out of memory) is started again, once
                self._loaded(model)
                try:
                    answer = self._exchange({"model": model, "endpoint": endpoint, "body": body}, timeout_s)
                except _Gone:
                    if attempt == 2:
                        raise CountFailed("The count worker ended while counting a body.") from None
                    continue
                if "timed_out" in answer:  # vLLM's own render timeout: its render thread may still run
                    self._kill()
                    raise TimedOut(answer["timed_out"])
                if "failed" in answer:
                    raise CountFailed(answer["failed"])
                return answer["tokens"] if "tokens" in answer else None
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _loaded(self, model: str) -> int:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if model not in self._context:
            try:
                answer = self._exchange({"model": model, "load": True}, START_TIMEOUT_S)
            except (_Gone, TimedOut):
                self._kill()
                raise CountFailed(f"The count worker could not load {model} within {START_TIMEOUT_S:g} s.") from None
            if "failed" in answer:
                raise CountFailed(f"The count worker could not load {model}: {answer['failed']}")
            self._context[model] = answer["loaded"]
        return self._context[model]

    def _start(self) -> None:
        self._kill()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its info lines would fill the asking process's log
        # Its own session: a terminal's Ctrl-C reaches the asking process, which ends the worker by closing its stdin.
        self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                      start_new_session=True)
        self._watcher = orphans.watch([self._proc.pid])  # killed with its asking process, even mid-render
        assert self._proc.stdin is not None
        os.set_blocking(self._proc.stdin.fileno(), False)
        try:
            ready = self._read(time.monotonic() + START_TIMEOUT_S)
        except _Gone:
            raise CountFailed("The count worker ended as it started (its error is in this process's log).") from None
        except TimedOut:
            self._kill()
            raise CountFailed(f"The count worker did not start within {START_TIMEOUT_S:g} s.") from None
        if not ready.get("ready"):
            self._kill()
            raise CountFailed(f"The count worker did not start: {ready}")
        log.info("count worker %d started (%s)", self._proc.pid, self.command[-1])

    def _kill(self) -> None:
        proc, self._proc, self._pending, self._context = self._proc, None, b"", {}
        if proc is None:
            return
        try:
            os.killpg(proc.pid, 9)  # its session: the worker and any thread or child it started
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        orphans.release(self._watcher)
        self._watcher = None

    def _exchange(self, ask: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        try:
            self._write(orjson.dumps(ask) + b"\n", deadline)
            return self._read(deadline)
        except TimedOut:
            self._kill()
            raise

    def _write(self, data: bytes, deadline: float) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        fd, view = self._proc.stdin.fileno(), memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimedOut("The count worker took no more input in time.")
            if not _ready(fd, select.POLLOUT, left):
                continue
            try:
                view = view[os.write(fd, view[:1 << 16]):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError):
                self._kill()
                raise _Gone() from None

    def _read(self, deadline: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimedOut("The count worker did not answer in time.")
            if not _ready(fd, select.POLLIN, left):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._kill()
                raise _Gone()
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return orjson.loads(line)


def _ready(fd: int, event: int, timeout_s: float) -> bool:
    """Whether `fd` is ready for `event` (or closed) within `timeout_s`. poll, not select: the API's descriptors
    pass select's 1,024 under load."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(timeout_s, 0.0) * 1000))


_WORKERS: dict[tuple[str, str, str], CountWorker] = {}
_WORKERS_LOCK = threading.Lock()


def shared_worker(models_file: str, model_cache_dir: str) -> CountWorker:
    """This process's count worker for the registry (one, kept for the process's life: started on first use)."""
    key = (models_file, model_cache_dir, FACTORY)
    with _WORKERS_LOCK:
        if key not in _WORKERS:
            _WORKERS[key] = CountWorker(*key)
        return _WORKERS[key]


@atexit.register
def close_workers() -> None:
    """End this process's count workers (each starts again on its next count)."""
    with _WORKERS_LOCK:
        for worker in _WORKERS.values():
            worker.close()


def worker_count(worker: CountWorker, model: str) -> TimedCount:
    return lambda endpoint, body, timeout_s: worker.count(model, endpoint, body, timeout_s)


# vLLM's answers to a body it will not run: a bad request, an unknown model, a body its request model refuses.
_REFUSALS = (400, 404, 422)


class ServersAway(Exception):
    """No replica answers with vLLM's render routes (none reachable, or a vLLM without them)."""


class ServerCount:
    """The model's bodies rendered by its servers (a fleet's router lists its replicas), vLLM's render path warm
    there. A replica that takes too long is given up (its own render timeout stops its work)."""

    def __init__(self, urls: list[str], model: str, api_key: str | None = None):
        self.model = model
        self.client = httpx.Client(headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        replicas: list[str] = []
        for base in urls:
            base = base.rstrip("/")
            try:
                listed = healthy_workers(self.client.get(base + "/workers", timeout=5))
            except httpx.HTTPError:
                listed = []
            replicas += listed or [base]
        self.replicas = list(dict.fromkeys(replicas))
        self._turn = 0

    def context_length(self) -> int | None:
        """The model's context length as its servers run it (GET /v1/models), or None when none says."""
        for replica in self.replicas:
            try:
                models = self.client.get(replica + "/v1/models", timeout=5).json().get("data", [])
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            for entry in models if isinstance(models, list) else []:
                if isinstance(entry, dict) and entry.get("id") == self.model and isinstance(
                        entry.get("max_model_len"), int):
                    return entry["max_model_len"]
        return None

    def count(self, endpoint: str, body: dict[str, Any], timeout_s: float) -> list[int] | None:
        for _ in self.replicas:
            replica = self.replicas[self._turn % len(self.replicas)]
            self._turn += 1
            try:
                answer = self.client.post(f"{replica}{endpoint}/render", timeout=timeout_s,
                                          json=vllm_body(endpoint, without_images(endpoint, body)))
            except httpx.TimeoutException:
                raise TimedOut(f"{replica} did not render the body in time.") from None
            except httpx.HTTPError:
                continue
            try:
                payload = answer.json()
            except ValueError:
                continue
            if answer.status_code == 200:
                return [len(r["token_ids"]) for r in (payload if isinstance(payload, list) else [payload])]
            # vLLM refuses a body in its own error shape (a route it does not have answers FastAPI's {"detail": ...});
            # anything else (403: a server without --enable-scale-out; 5xx) says nothing of the body.
            if answer.status_code in _REFUSALS and isinstance(payload, dict) and "error" in payload:
                return None
        raise ServersAway(f"No server of {self.model} renders bodies ({', '.join(self.replicas)}).")


def servers_then_worker(servers: ServerCount, worker: TimedCount) -> TimedCount:
    """The servers' count while they answer; the worker's from the first body none of them renders."""
    away = False

    def count(endpoint: str, body: dict[str, Any], timeout_s: float) -> list[int] | None:
        nonlocal away
        if not away:
            try:
                return servers.count(endpoint, body, timeout_s)
            except ServersAway as exc:
                log.warning("%s; counting with a count worker instead", exc)
                away = True
        return worker(endpoint, body, timeout_s)

    return count
