"""The in-process engine: `vllm serve`'s own application on an in-process async engine, without a socket.

As vLLM's batch runner does, the engine is built from the server's arguments (`build_async_engine_client`) and
the server's serving objects on it (`init_app_state`); here they sit behind the server's own FastAPI app (its
request models, its error handling, its serialization), which each request reaches over an in-process ASGI
transport. So a line is answered exactly as a fleet's server answers it. The engine runs on an event loop in a
thread of its own (a Dagster step is synchronous), built once per model and process and reused across shards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import multiprocessing.util
import threading
import time
import types
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from batch_dagster.batchfile.registry import ModelSpec

from . import lines as ln
from . import orphans
from .base import EngineCrash, Line, OnProgress, Request, dispatch
from .flags import parsed_args
from .hardware import dtype_choice

log = logging.getLogger(__name__)
T = TypeVar("T")
# The in-process app's address: requests never leave the process, but HTTP wants a host.
_BASE_URL = "http://vllm.in-process"


@dataclass
class _Running:
    """A started engine: its event loop's thread, vLLM's engine client, the app's client, what closes them."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    engine: Any  # vllm.engine.protocol.EngineClient (an AsyncLLM)
    client: Any  # httpx.AsyncClient on the app
    stack: contextlib.AsyncExitStack


@dataclass
class OfflineEngine:
    """Runs shards for one model on `vllm serve`'s application in this process."""

    spec: ModelSpec
    model_path: str
    start_s: float = field(default=0.0, init=False)  # how long starting the engine took
    started_at: float | None = field(default=None, init=False)  # time.perf_counter() when it was ready
    _running: _Running | None = field(default=None, init=False, repr=False)

    # -- starting and stopping -----------------------------------------------------------

    def start(self) -> None:
        """Start the engine, unless it runs already."""
        if self._running is not None:
            return
        choice = dtype_choice(self.spec.dtype)
        log.info("Starting vLLM for %s from %s in %s: %s", self.spec.name, self.model_path, choice.dtype,
                 choice.reason)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True, name=f"vllm-{self.spec.name}")
        thread.start()
        before = _engine_processes()
        t0 = time.perf_counter()
        stack = contextlib.AsyncExitStack()
        try:
            engine, client = asyncio.run_coroutine_threadsafe(self._open(stack), loop).result()
        except BaseException:
            _stop_loop(loop, thread, stack)
            raise
        self.started_at = time.perf_counter()
        self.start_s = round(self.started_at - t0, 3)
        # Killed, this process would leave its engine core running (vLLM does not watch its parent). The other way
        # round vLLM watches: its engine client fails every request within a second of its core's death.
        orphans.watch(sorted(_engine_processes() - before))
        self._running = _Running(loop, thread, engine, client, stack)
        # multiprocessing's exit hook joins every child process, the engine core included, which waits forever
        # unless the engine was stopped first. A finalizer with an exit priority runs before that join, in the main
        # process and in a multiprocessing child (Dagster's step processes) alike, where atexit handlers never run.
        multiprocessing.util.Finalize(None, shutdown_all, exitpriority=100)

    async def _open(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        """vLLM's engine client and its server's app, as `vllm serve` builds them, and an HTTP client on the app."""
        import httpx
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.usage.usage_lib import UsageContext

        args = parsed_args(self.spec, self.model_path)
        engine = await stack.enter_async_context(
            build_async_engine_client(args, usage_context=UsageContext.OPENAI_BATCH_RUNNER))
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        # Where the app's handler of a dead engine stops "the server" (uvicorn's should_exit); here run() sees it.
        app.state.server = types.SimpleNamespace(should_exit=False)
        await stack.enter_async_context(app.router.lifespan_context(app))  # what the server starts with its app
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=_BASE_URL, timeout=None))
        return engine, client

    def shutdown(self) -> None:
        """Stop the engine (after a crash, so the next attempt starts a fresh one, or at the end)."""
        running, self._running = self._running, None
        if running is None:
            return
        # No grace period, as vLLM's own run_batch stops its engine: nothing is in flight when an engine is dropped.
        _stop_loop(running.loop, running.thread, running.stack)
        del running
        gc.collect()  # vLLM's engine client is collected now, not in the interpreter's teardown (where it raises)

    # -- running -----------------------------------------------------------------------

    def run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None = None) -> list[Line]:
        """All of a shard's requests go to the engine at once, so continuous batching stays full."""
        try:
            self.start()
        except Exception as exc:  # start-up failures are crashes of the engine, not of a request
            raise EngineCrash(f"The engine failed to start: {exc}") from exc
        lines = self._call(self._run_isolating(endpoint, list(requests), on_progress))
        if len(lines) > 1 and all(line["response"]["status_code"] >= 500 for line in lines):
            # Every request failed, none by its own fault (that is a 400): the engine is at fault.
            first_error = lines[0]["response"]["body"]["error"]["message"]
            raise EngineCrash(f"Every request of the shard failed: {first_error}")
        return lines

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the engine's loop and wait for it; stopped here (the step interrupted), it is cancelled,
        and vLLM aborts its requests."""
        assert self._running is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self._running.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    async def _run_isolating(self, endpoint: str, requests: list[Request],
                             on_progress: OnProgress | None) -> list[Line]:
        """Run requests; those that ran out of memory together run again in halves, until one that does alone."""
        lines = await self._execute(endpoint, requests, on_progress)
        oom = [i for i, line in enumerate(lines) if ln.failed_for_memory(line)]
        if not oom or len(requests) == 1:
            if oom and on_progress is not None:  # the culprit, alone: its line is final
                on_progress(1)
            return lines
        log.warning("Running %d of %d requests again after they ran out of memory", len(oom), len(requests))
        again = [requests[i] for i in oom]
        mid = len(again) // 2
        rerun: list[Line] = []
        for half in (again[:mid], again[mid:]) if mid else (again,):
            rerun += await self._run_isolating(endpoint, half, on_progress)
        for i, line in zip(oom, rerun, strict=True):
            lines[i] = line
        return lines

    async def _execute(self, endpoint: str, requests: list[Request], on_progress: OnProgress | None) -> list[Line]:
        async def send(custom_id: str, body: dict[str, Any], lane: int) -> Line:
            return await self._send(endpoint, custom_id, body)

        lines = await dispatch(endpoint, requests, send, serves=self.spec.serves, on_progress=on_progress,
                               counted=lambda line: not ln.failed_for_memory(line))
        dead = self._dead()
        if dead is not None:  # its requests failed with it: the shard is retried on a new engine
            raise EngineCrash(f"The engine died: {type(dead).__name__}: {dead}") from dead
        return lines

    async def _send(self, endpoint: str, custom_id: str, body: dict[str, Any]) -> Line:
        """One request through the app, as a server's client sends it."""
        assert self._running is not None
        response = await self._running.client.post(endpoint, json=body)
        try:
            return ln.answer_line(custom_id, response.status_code, response.json())
        except ValueError:  # not JSON (an event stream): no answer a batch line can hold
            message = f"The engine answered {response.headers.get('content-type')!r}, not a JSON body."
            return ln.answer_line(custom_id, 500, {"error": {"message": message}})

    def _dead(self) -> BaseException | None:
        """Why the engine is dead (vLLM's EngineDeadError), or None while it runs."""
        assert self._running is not None
        engine = self._running.engine
        return engine.dead_error if engine.errored else None


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, stack: contextlib.AsyncExitStack) -> None:
    """Close what `stack` opened on `loop` (the engine, the app), then stop the loop and its thread."""
    try:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=60)
    except (Exception, concurrent.futures.TimeoutError):  # already dead: nothing left to stop
        log.debug("Stopping the engine", exc_info=True)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    if not thread.is_alive():
        loop.close()


_ENGINES: dict[str, OfflineEngine] = {}
_LOCK = threading.Lock()


def _engine_processes() -> set[int]:
    """This process's children that are vLLM engine processes (vLLM names them VLLM::...)."""
    import psutil

    out = set()
    for child in psutil.Process().children():
        try:
            if child.name().startswith("VLLM"):
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def shutdown_all() -> None:
    """Stop every engine of this process.

    Registered at exit: otherwise multiprocessing's exit hook waits forever on the engine-core
    child that nobody told to stop, and the process never ends.
    """
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    if engines:
        # At exit the streams vLLM logs to may be closed already (pytest's capture, for one), and an engine stopping
        # logs its client's end as an error: neither must print a traceback.
        for name in [n for n in logging.root.manager.loggerDict if n == "vllm" or n.startswith("vllm.")]:
            logging.getLogger(name).disabled = True
        logging.raiseExceptions = False
    for engine in engines:
        engine.shutdown()


def engine_for(spec: ModelSpec, model_path: str) -> OfflineEngine:
    """The process's engine for this model: built once, reused across shards and runs."""
    with _LOCK:
        engine = _ENGINES.get(spec.name)
        if engine is None or engine.spec != spec or engine.model_path != model_path:
            if engine is not None:
                engine.shutdown()
            engine = _ENGINES[spec.name] = OfflineEngine(spec, model_path)
        return engine


def running(model: str) -> bool:
    """Whether this process already holds an engine for the model."""
    with _LOCK:
        return model in _ENGINES


def start_seconds(model: str, since: float) -> float:
    """How long the model's engine took to start, if it started after `since` (perf_counter); 0 for one reused."""
    with _LOCK:
        engine = _ENGINES.get(model)
    if engine is None or engine.started_at is None or engine.started_at < since:
        return 0.0
    return engine.start_s


def drop_engine(model: str) -> None:
    with _LOCK:
        engine = _ENGINES.pop(model, None)
    if engine is not None:
        engine.shutdown()
