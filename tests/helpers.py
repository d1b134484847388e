"""What the tests share, in one module: batch files, definitions, the fake engine, and the harnesses that serve
the API in-process, play the Dagster daemon for the sensors, and run `serve` for real.

Tests import from here, never from a conftest.py (those hold fixtures only). The heavier libraries of the
harnesses (uvicorn, the openai SDK, psutil, the API app) are imported where they are used, so that importing
this module stays cheap, also for the daemon's processes that load tests/daemon_defs.py.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import dagster as dg
import orjson
from dagster._core.storage.defs_state.base import DefsStateStorage

from batch_dagster.batchfile import anthropic, responses
from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.batchfile.results import committed_shards, shard_keys
from batch_dagster.defs.assets.batch import lifecycle
from batch_dagster.defs.assets.checks import lifecycle_checks
from batch_dagster.defs.jobs import batch_job
from batch_dagster.defs.resources import DatabaseResource, LazyS3Resource, PipelineConfig, StorageResource, VLLMResource
from batch_dagster.defs.table.component import IO_MANAGER, PIPELINE, STORAGE, VLLM
from batch_dagster.defs.table.io_manager import TableIOManager
from batch_dagster.engine.base import EngineCrash, Line, Request
from batch_dagster.engine.lines import RequestError
from batch_dagster.engine.models import Models
from batch_dagster.engine.offline import OfflineEngine
from batch_dagster.settings import Settings
from batch_dagster.storage import LocalStorage

if TYPE_CHECKING:
    import httpx
    import psutil
    from openai import OpenAI
    from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parents[1]
# Read when the tests are collected, before any test moves BATCH_DATA_DIR, so the prepared models are shared.
MODEL_CACHE = Settings.from_env().model_cache_dir
STEP_RETRY_DELAY_S = Settings.from_env().step_retry_delay_s  # conftest.py's, so a test's retries wait little
CHAT_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"
# Run config that keeps in-process runs quiet.
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
# Dagster's test instance keeps each run's stdout and stderr by starting a `tail` and a Python watcher for each
# (dagster/_core/execution/compute_logs.py): four processes and about half a second a run. Only the tests of the
# logs themselves (test_retention.py) ask for them.
NO_STEP_LOGS = {"compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                 "class": "NoOpComputeLogManager"}}
# The runs' events in memory (Dagster's own in-memory event log), not in a SQLite file per run that Dagster connects to
# again for every event: that was the largest part of an in-process run's time. The tests run their runs in this
# process (execute_in_process), never in another that would have to read them.
IN_MEMORY_EVENTS = {"event_log_storage": {"module": "dagster._core.storage.event_log",
                                          "class": "InMemoryEventLogStorage"}}


# An empty test instance's folder per configuration, made once per process and copied for each test: a new one's
# SQLite run and schedule storages were most of the time it took to open (their schema, then Dagster's data
# migrations).
_INSTANCE_TEMPLATES: dict[str, Path] = {}
_TEMPLATES_LOCK = threading.Lock()


@contextmanager
def dagster_instance(step_logs: bool = False, events_on_disk: bool = False) -> Iterator[dg.DagsterInstance]:
    """A new, empty test Dagster instance, without the runs' step logs and with its events in memory, unless asked
    (`events_on_disk`: SQLite's event log, a database per run, as a project instance keeps them)."""
    overrides = ({} if events_on_disk else IN_MEMORY_EVENTS) | ({} if step_logs else NO_STEP_LOGS)
    key = json.dumps(overrides, sort_keys=True)
    with _TEMPLATES_LOCK:
        if key not in _INSTANCE_TEMPLATES:
            template = Path(tempfile.mkdtemp(prefix="dagster-instance-"))
            atexit.register(shutil.rmtree, template, True)
            with dg.instance_for_test(overrides=overrides, temp_dir=str(template)):
                pass
            _INSTANCE_TEMPLATES[key] = template
    with tempfile.TemporaryDirectory(prefix="dagster-instance-") as tmp:
        home = Path(tmp) / "home"
        shutil.copytree(_INSTANCE_TEMPLATES[key], home)
        with dg.instance_for_test(overrides=overrides, temp_dir=str(home)) as instance:
            own = DefsStateStorage.get()
            yield instance
            _check_nothing_left_open(own)


def _check_nothing_left_open(own: DefsStateStorage | None) -> None:
    """Entering a Dagster instance makes its state storage the ambient one (a context variable) until it exits, which
    sets back the one before. A context built inside a test's instance without `with` (`build_input_context()`,
    `build_schedule_context()`, ... without one, each enters an ephemeral instance of its own) exits only when the
    garbage collector takes it: if that is after this instance has closed, the ambient storage is set back to this
    closed one, and every later test of the process that loads definitions fails on it (CI, f85e33d: "unable to
    open database file" in another test). Said here, in the test that left it open."""
    if DefsStateStorage.get() is not own:
        raise AssertionError("A Dagster context entered inside this test's instance is still open as the instance "
                             "closes: use it in a `with` block (dg.build_input_context(...), "
                             "dg.build_sensor_context(...), ...), and pass it the test's instance.")


# Batch files.

# The demo's system prompt (batch_dagster/demo): with it the small model answers a plain question in both of the
# dtypes it runs in; without it, in bfloat16 (a CPU with avx512_bf16 or amx_bf16), SmolLM2-135M answers "What is
# the capital of France?" with "L'Étoile, la Marseillaise, la femme, ..." (float32: "The capital of France is Paris.").
CONCISE = "You are a concise assistant. Answer the question in one short sentence."


def chat_request(custom_id: str, content: str, model: str = CHAT_MODEL, system: str | None = None, **params) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": model, "messages": messages, **params}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def rows(n: int, prefix: str = "r", **params) -> list[dict]:
    """n chat requests of growing length, custom_ids `<prefix>0` ... `<prefix><n-1>`."""
    return [chat_request(f"{prefix}{i}", f"question {i} " + "word " * i, **params) for i in range(n)]


def jsonl(rows: list) -> bytes:
    """A batch file's bytes; a str row is written as it is (to make broken lines)."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Network.

def free_port() -> int:
    """A loopback port free now, outside the range the system gives outgoing connections their ports from: one the
    system picked (bind to 0) was once taken by another test's connection before the server meant for it bound it."""
    from batch_dagster.serve.fleet import free_port_block

    return free_port_block(1, "127.0.0.1")


class Outage:
    """A TCP proxy on a loopback port to `target_port`, which a test takes down (its connections closed, new ones
    refused, as a store that went away refuses them) and brings back on the same port."""

    def __init__(self, target_port: int):
        self.port, self.target = free_port(), target_port
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.trip: re.Pattern[bytes] | None = None
        self.tripped = threading.Event()
        self.up()

    def down_at(self, pattern: bytes) -> None:
        """Go down at the first request whose bytes match `pattern` (e.g. a PUT of a key), that request unsent."""
        self.tripped.clear()
        self.trip = re.compile(pattern)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = self.listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the same port
        listener.settimeout(0.2)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        with self.lock:
            conns, self.conns = self.conns, set()
        for conn in conns:
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while self.listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self.trip is not None and self.trip.search(data):
                    self.trip = None
                    self.down()
                    self.tripped.set()
                    break
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
            with self.lock:
                self.conns.discard(s)


@functools.cache
def tls() -> ssl.SSLContext:
    """One TLS context for the tests' HTTP clients: a client made without one loads the CA bundle again (tens of
    milliseconds of CPU, for each of a flood's requests), though what the tests call is plain HTTP on loopback."""
    import httpx

    return httpx.create_ssl_context()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to `proc`'s process group, as a terminal's Ctrl-C; killed if it has not left within 30 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_http(url: str, timeout_s: float, proc=None) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2, verify=tls()).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a server up in 1.1 s is seen then, not at 2 s (moto's S3 once per module)
    raise TimeoutError(url)


@contextmanager
def webserver(args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None):
    """dagster-webserver on a free loopback port with `args` (its code location), until the block ends: its URL."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("dagster-webserver")), "-h", "127.0.0.1",
                                 "-p", str(port), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_http(f"http://127.0.0.1:{port}/server_info", 120, proc)
            time.sleep(2)  # the code location loads after the server answers
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def new_database(server_url: str) -> str:
    """A new, empty database on the PostgreSQL server at `server_url` (a URL without a database name): its URL."""
    import uuid

    import psycopg2

    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(f"{server_url}/postgres".replace("+psycopg2", ""))
    conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    conn.close()
    return f"{server_url}/{name}"


class Receiver:
    """A webhook endpoint on loopback that records each POST (headers, body, status it answered); it answers
    `statuses` in turn, then 200."""

    def __init__(self, *statuses: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.statuses = list(statuses)
        self.posts: list[tuple[dict[str, str], bytes, int]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.posts.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[dict]:
        """The events it answered 200 to."""
        return [json.loads(body) for _, body, status in self.posts if status == 200]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class InferenceGate:
    """A reverse proxy on loopback in front of a real server (a fleet's URL) that holds every inference request (a POST
    under /v1/) until it has seen one whose body names each of `markers` (words in the prompts of batches meant to
    run side by side), or until the test calls open(); then it lets everything through. So batches that can run
    together do, whatever the CPU's speed; batches the queue kept apart would hold the first one's requests until
    `timeout_s`, then go on: `opened_at` stays None, which the test asserts against. Other requests (health, models,
    /tokenize, a body's /render) pass at once."""

    def __init__(self, upstream: str, markers: Sequence[str] = (), timeout_s: float = 240):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        import httpx

        self.markers, self.seen, self.opened_at = set(markers), set[str](), None
        self._open = threading.Event()
        http = httpx.Client(base_url=upstream, timeout=600)
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                # A body's render (validation's and the estimate's count: engine/counting.py) is no inference.
                if method == "POST" and self.path.startswith("/v1/") and not self.path.endswith("/render"):
                    text = body.decode(errors="replace")
                    gate.seen |= {m for m in gate.markers if m in text}
                    if gate.markers and gate.seen == gate.markers:
                        gate.open()
                    gate._open.wait(timeout_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                response = http.request(method, self.path, content=body, headers=headers)
                self.send_response(response.status_code)
                self.send_header("content-type", response.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(response.content)))
                self.end_headers()
                self.wfile.write(response.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def open(self) -> None:
        if not self._open.is_set():
            self.opened_at = time.time()
            self._open.set()

    def close(self) -> None:
        """Hold the inference requests from now on again, until the next open()."""
        self._open.clear()

    def __enter__(self) -> InferenceGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.set()
        self.server.shutdown()
        self.server.server_close()


# Definitions.

def make_defs(data_dir: Path, vllm: VLLMResource, shard_size: int = 1000, storage_url: str = "",
              database_url: str = "", intake_api_key: str = "", **pipeline: Any) -> dg.Definitions:
    """batch_job over `data_dir` (or batch folders at `storage_url`) on `vllm`, cutting shards of `shard_size`
    (`pipeline`: PipelineConfig's other fields); its steps read the store at `database_url` (none: no store), where a
    command-line batch belongs to `intake_api_key`'s owner (none: the keyless one)."""
    return dg.Definitions(
        assets=lifecycle(STEP_RETRY_DELAY_S),
        asset_checks=lifecycle_checks,
        jobs=[batch_job],
        resources={"storage": StorageResource(data_dir=str(data_dir), url=storage_url), "vllm": vllm, "s3": LazyS3Resource(),
                   "pipeline": PipelineConfig(shard_size=shard_size, **pipeline),
                   "database": DatabaseResource(url=database_url, intake_api_key=intake_api_key)},
    )


def real_vllm(**kwargs) -> VLLMResource:
    return VLLMResource(**{"models_file": str(Settings.from_env().models_file), "model_cache_dir": str(MODEL_CACHE),
                           **kwargs})


def run_on_real_engine(tmp_path: Path, data_dir: Path, instance: dg.DagsterInstance, rows: list,
                       shard_size: int = 1000, **vllm_kwargs):
    """`run_batch` of `rows` on the real engine: the summary, and the output and error lines by custom_id."""
    from batch_dagster.defs.runner import run_batch

    defs = make_defs(data_dir, real_vllm(**vllm_kwargs), shard_size=shard_size)
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    out = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out" / "output.jsonl")}
    err = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    return summary, out, err


# The fake engine, for fast pipeline tests: deterministic answers, countable calls, injectable faults.

@dataclass
class FakeEngine:
    """Echoes the last user message; `crash_times` shards crash before it behaves."""

    crash_times: int = 0
    calls: list[list[str]] = field(default_factory=list)
    on_call: Callable[[int], None] | None = None  # called with the call number, e.g. to cancel mid-batch
    fail_once: set[str] = field(default_factory=set)  # custom_ids answered once with a 500 line of `fail_code`
    fail_code: str = c.OUT_OF_MEMORY  # or c.ENGINE_ERROR: what a fleet that is down answers
    refuse: set[str] = field(default_factory=set)  # custom_ids answered with a 400 line: the request's own failure
    on_request: Callable[[int], None] | None = None  # called after each finished request with the count so far

    def run(self, endpoint: str, requests: Sequence[Request],
            on_progress: Callable[[int], None] | None = None) -> list[Line]:
        self.calls.append([cid for cid, _ in requests])
        if self.on_call is not None:
            self.on_call(len(self.calls))
        if self.crash_times > 0:
            self.crash_times -= 1
            raise EngineCrash("fake engine died")
        lines = []
        for cid, original in requests:
            body = responses.chat_body(original) if endpoint == c.RESPONSES else \
                anthropic.chat_body(original) if endpoint == c.MESSAGES else original
            if body.get("temperature", 1) < 0:
                lines.append(RequestError("temperature must be non-negative", param="temperature").line(cid))
                continue
            if cid in self.fail_once:
                self.fail_once.discard(cid)
                lines.append(c.request_error_line(cid, self.fail_code, f"fake {self.fail_code}", status_code=500))
                continue
            if cid in self.refuse:
                lines.append(c.request_error_line(cid, c.INVALID_REQUEST, "fake refusal", status_code=400))
                continue
            text = str(body["messages"][-1]["content"]) if "messages" in body else str(body.get("prompt"))
            words = text.split()
            answer = words[: body.get("max_tokens", 16)]
            lines.append(c.success_line(cid, fake_body(endpoint, body["model"], f"echo: {' '.join(answer)}",
                                                       len(words), len(answer) + 1)))
            if on_progress is not None:
                report_load = getattr(on_progress, "report_load", None)
                if report_load is not None:  # as the engines do: its load just before each update
                    report_load(f"{len(requests) - len(lines)} unfinished")
                on_progress(1)
            if self.on_request is not None:
                self.on_request(len(lines))
        return lines


def fake_body(endpoint: str, model: str, text: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A response body of the fake engine, shaped as vLLM's: a `response` object for /v1/responses, a chat
    completion otherwise (with the usage fields the pipeline reads)."""
    if endpoint == c.MESSAGES:
        return {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}}
    if endpoint == c.RESPONSES:
        return {"id": "resp_fake", "object": "response", "model": model, "status": "completed",
                "output": [{"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": "chatcmpl-fake", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


class InProcessStub(OfflineEngine):
    """The in-process engine with vLLM's app swapped for `answer(custom_id, body, ids of the call) -> line`: its
    dispatch, checks, isolation and crash rules as they are, no model. `calls` holds each engine call's ids."""

    def __init__(self, answer: Callable[[str, dict[str, Any], list[str]], Line] | None = None):
        super().__init__(ModelSpec(name=CHAT_MODEL, source="/nowhere"), "/nowhere")
        self.answer = answer or (lambda cid, body, ids: c.success_line(cid, fake_body(c.CHAT, CHAT_MODEL, "ok", 1, 1)))
        self.calls: list[list[str]] = []

    def start(self) -> None:  # nothing to start
        pass

    def _call(self, coroutine: Any) -> Any:
        import asyncio

        return asyncio.run(coroutine)

    async def _execute(self, endpoint: str, requests: list[Request], on_progress: Any) -> list[Line]:
        self.calls.append([cid for cid, _ in requests])
        return await super()._execute(endpoint, requests, on_progress)

    async def _send(self, endpoint: str, custom_id: str, body: dict[str, Any]) -> Line:
        return self.answer(custom_id, body, self.calls[-1])

    def _dead(self) -> str | None:
        return None


FAKES: dict[str, Any] = {}


class WordTokenizer:
    """One token per word of the text, as the fake engine bills: counts an embedding model's inputs exactly for it,
    and loads instantly (set as Models.tokenizer by `count_words`)."""

    def encode(self, text, add_special_tokens=True):
        return text.split()


WORD_RENDERER = "tests.word_render:WordRenderer"


def count_words(monkeypatch: Any) -> None:
    """Every model's tokens counted one per word, as the fake engine bills them: a generation model's bodies by a
    count worker that renders words (tests/word_render.py, no vLLM), an embedding model's inputs by WordTokenizer."""
    from batch_dagster.engine import counting

    monkeypatch.setattr(counting, "FACTORY", WORD_RENDERER)
    monkeypatch.setattr(Models, "tokenizer", lambda self, model: WordTokenizer())


class FakeVLLM(VLLMResource):
    """The vLLM resource with the engine swapped for `FAKES[fake]`."""

    fake: str = "default"

    def engine(self, model: str) -> Any:
        self.spec(model)
        return FAKES[self.fake]

    def reset(self, model: str) -> None:
        pass

    def engine_starts_here(self, model: str) -> bool:
        """No engine starts in this process, so validation keeps its count worker for the next batch: started
        again for each batch, 120 word workers took about 45 s of tests/api's CPU."""
        return False

    def model_record(self, model: str) -> dict[str, Any]:
        urls = self.server_urls_for(model)  # a fleet set on the fake is named as the real record names it
        return {"model": model, "revision": "fake", "engine_mode": "fake" if urls is None else "server",
                "engine_url": ",".join(urls) if urls else None, "engine_settings": {}, "vllm_version": "none",
                "seed": 0}


def fake_vllm(name: str, engine: Any, cls: type[FakeVLLM] = FakeVLLM, **settings: Any) -> FakeVLLM:
    """A vLLM resource (of class `cls`, with `settings`) whose engine is `engine`, registered under `name`."""
    FAKES[name] = engine
    return cls(models_file=str(Settings.from_env().models_file), model_cache_dir="/nonexistent", fake=name,
               **settings)


# The API in-process: uvicorn on loopback, the openai SDK as its client, and a worker that plays the daemon.

KEY_A, KEY_B = "sk-test-a", "sk-test-b"


class Worker(threading.Thread):
    """Plays the Dagster daemon: ticks the sensors and runs each requested partition of batch_job."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance | Callable[[], dg.DagsterInstance],
                 resources: dict, interval_s: float = 0.2):
        super().__init__(daemon=True, name="dagster-worker")
        self.defs, self.resources, self.interval_s = defs, resources, interval_s
        # The sensors' resources initialized once, as the daemon would each tick: they are plain configuration (no
        # set-up, no teardown, no state), and Dagster's initialization of configurable resources (their config
        # schemas, again for each sensor call) was most of a tick's time, ticking every 0.2 s all through a test.
        with dg.build_resources(resources, instance=_resource_instance()) as built:
            self.sensor_resources = {name: dg.ResourceDefinition.hardcoded_resource(getattr(built, name))
                                     for name in resources}
        self._instance = instance  # or how to open it: opened when first needed (many API tests never need it)
        self.stopping = threading.Event()
        self.ran: list[str] = []
        self.errors: list[BaseException] = []

    @property
    def instance(self) -> dg.DagsterInstance:
        if not isinstance(self._instance, dg.DagsterInstance):
            self._instance = self._instance()
        return self._instance

    def tick(self) -> None:
        from batch_dagster.defs.sensors import api_batch_sensor

        result = api_batch_sensor(dg.build_sensor_context(instance=self.instance, resources=self.sensor_resources))
        if isinstance(result, dg.SensorResult):
            for request in result.dynamic_partitions_requests or []:
                self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            for run in result.run_requests or []:
                self.defs.resolve_job_def("batch_job").execute_in_process(
                    partition_key=run.partition_key, instance=self.instance, raise_on_error=False,
                    tags={**run.tags, "dagster/run_key": run.run_key},  # as the daemon tags a sensor's run
                    run_config=QUIET,
                )
                self.ran.append(run.partition_key)
        self.follow()

    def follow(self) -> None:
        """A tick of the status sensor alone: the daemon ticks it while runs go on, which this worker's runs,
        executed in its own thread, otherwise hold up until they end."""
        from batch_dagster.defs.eta import queue_eta_sensor
        from batch_dagster.defs.sensors import api_batch_status_sensor

        api_batch_status_sensor(dg.build_sensor_context(instance=self.instance, resources=self.sensor_resources))
        queue_eta_sensor(dg.build_sensor_context(instance=self.instance, resources=self.sensor_resources))

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick()
            except BaseException as exc:  # surfaced by the fixture's teardown, and said now (a test then waits)
                self.errors.append(exc)
                traceback.print_exc()
                return
            self.stopping.wait(self.interval_s)


@functools.cache
def _resource_instance() -> dg.DagsterInstance:
    """The instance the sensors' resources are initialized with (none of them uses it): without one, Dagster makes an
    ephemeral instance for each Worker, a sixth of starting the API."""
    return dg.DagsterInstance.ephemeral()


class ApiServer:
    """uvicorn in a thread on a free loopback port (`config`: more of uvicorn's settings, e.g. root_path)."""

    def __init__(self, app, **config: Any):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Service:
    """The API served in-process (see the `start_service` fixture), its worker, and where they keep things."""

    url: str
    data_dir: Path
    config: Settings
    engine: FakeEngine
    worker: Worker
    storage: StorageResource
    clients: list[OpenAI] = field(default_factory=list)
    metrics_url: str = ""  # the metrics' own listener (the operator's), http://host:port/metrics

    @property
    def instance(self) -> dg.DagsterInstance:
        return self.worker.instance

    def client(self, api_key: str = KEY_A) -> OpenAI:
        from openai import DefaultHttpxClient, OpenAI

        client = OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30,
                        http_client=DefaultHttpxClient(verify=tls()))
        self.clients.append(client)
        return client

    def http(self, api_key: str | None = KEY_A) -> httpx.Client:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=tls())

    def start_worker(self) -> None:
        if not self.worker.is_alive():
            assert self.worker.instance is not None  # opened here, in the test's thread, not in the worker's
            self.worker.start()


# The API's store migrated to head once per process, then copied for each test: Alembic's migrations on a new SQLite
# file were a third of starting the API.
_STORE_TEMPLATE: list[Path] = []


def database_url(data_dir: Path) -> str:
    """SQLite in the test's folder, already at the schema's head (the API checks it, as at every start);
    BATCH_TEST_DATABASE_URL (e.g. a Postgres URL) runs the tests there, emptied first."""
    url = os.environ.get("BATCH_TEST_DATABASE_URL")
    if not url:
        path = data_dir / "api.db"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(_store_template(), path)
            path.chmod(0o600)  # as the store makes its file (db/session.py), whatever the umask
        return f"sqlite:///{path}"
    from sqlalchemy import text

    from batch_dagster.db import Database
    from batch_dagster.db.models import Base

    store = Database(url)
    Base.metadata.drop_all(store.engine)
    with store.engine.begin() as connection:
        connection.execute(text("DROP TABLE IF EXISTS alembic_version"))
    store.dispose()
    return url


def _store_template() -> Path:
    from batch_dagster.db import Database

    with _TEMPLATES_LOCK:
        if not _STORE_TEMPLATE:
            folder = Path(tempfile.mkdtemp(prefix="api-store-"))
            atexit.register(shutil.rmtree, folder, True)
            store = Database(f"sqlite:///{folder / 'api.db'}")
            store.upgrade()
            with store.engine.connect() as connection:  # all of it in the file itself, none in its write-ahead log
                connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            store.dispose()
            _STORE_TEMPLATE.append(folder / "api.db")
    return _STORE_TEMPLATE[0]


class Flood:
    """`n` POSTs of one key to `path`, each from a thread of its own, started at once; `statuses` gathers their
    answers' status codes as they come. `held()` is what the API holds (not answered yet)."""

    def __init__(self, service: Service, path: str, body: dict, n: int, api_key: str = KEY_A):
        self.statuses: list[int] = []

        def one() -> None:
            with service.http(api_key) as http:
                self.statuses.append(http.post(path, json=body, timeout=120).status_code)

        self.threads = [threading.Thread(target=one) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def wait_answered(self, n: int, timeout_s: float = 60) -> None:
        """Until `n` of the requests have their answer (AssertionError past `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.statuses) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.statuses) >= n, f"{len(self.statuses)} of {len(self.threads)} answered: {self.statuses}"

    def held(self) -> int:
        return len(self.threads) - len(self.statuses)

    def join(self) -> list[int]:
        for thread in self.threads:
            thread.join(120)
        return self.statuses


def upload(client: OpenAI, path: Path, rows: list) -> str:
    """Write `rows` to `path` and upload it with the openai SDK `client`; the file's id."""
    write_jsonl(path, rows)
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def wait_for(client: OpenAI, batch_id: str, statuses: set[str] | str, timeout_s: float = 60,
             seen: list[str] | None = None):
    """Poll a batch until its status is one of `statuses`; records each status seen on the way."""
    statuses = {statuses} if isinstance(statuses, str) else statuses
    deadline = time.time() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != batch.status):
            seen.append(batch.status)
        if batch.status in statuses:
            return batch
        if time.time() > deadline:
            raise TimeoutError(f"{batch_id} is still {batch.status} (waiting for {statuses})")
        time.sleep(0.1)


# Dropped files: the S3 and inbox sensors, evaluated as the daemon does.

BUCKET = "drops"


class Daemon:
    """Plays the Dagster daemon for the drop sensors: evaluates them with their cursor, runs what they request."""

    def __init__(self, tmp_path: Path, vllm: VLLMResource, storage_url: str = "", db_url: str = "", **intake):
        from batch_dagster.defs.assets.delivery import delivered_results
        from batch_dagster.defs.jobs import deliver_results_job
        from batch_dagster.defs.resources import Intake

        self.data_dir = tmp_path / "data"
        self.storage_url = storage_url
        self.storage = StorageResource(data_dir=str(self.data_dir), url=storage_url)
        self.db_url = db_url or f"sqlite:///{self.data_dir / 'api.db'}"
        self.intake = Intake(**{"inbox_dir": str(tmp_path / "inbox"), "outbox_dir": str(tmp_path / "outbox"),
                                "s3_bucket": BUCKET, "settle_s": 0, **intake})
        base = make_defs(self.data_dir, vllm, storage_url=storage_url, database_url=self.db_url)
        self.resources = {**base.resources, "database": DatabaseResource(url=self.db_url), "intake": self.intake}
        self.defs = dg.Definitions(assets=[*base.assets, delivered_results], asset_checks=base.asset_checks,
                                   jobs=[*base.jobs, deliver_results_job], resources=self.resources)
        self.instance = dg.DagsterInstance.ephemeral()
        self.cursors: dict[str, str | None] = {}
        self.requested: list[dg.RunRequest] = []  # every run request of every tick, with its tags

    def tick(self, sensor: dg.SensorDefinition, *, run: bool = True) -> list[tuple[str, str]]:
        """One evaluation of `sensor`; the (job, batch id) of each run it requested, executed unless run=False."""
        context = dg.build_sensor_context(instance=self.instance, resources=self.resources,
                                          cursor=self.cursors.get(sensor.name))
        result = sensor(context)
        if not isinstance(result, dg.SensorResult):
            return []
        self.cursors[sensor.name] = result.cursor
        self.requested += result.run_requests or []
        for request in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        requested = [(r.job_name, r.partition_key) for r in result.run_requests or []]
        for r in (result.run_requests or []) if run else []:
            outcome = self.defs.resolve_job_def(r.job_name).execute_in_process(
                partition_key=r.partition_key, instance=self.instance, raise_on_error=False, run_config=QUIET,
                tags={**r.tags, "dagster/partition": r.partition_key})
            assert outcome.success or r.job_name == "batch_job", f"{r.job_name} failed"
        return requested

    def follow(self) -> None:
        """The API's status sensor: brings the stored batches up to date with their runs."""
        from batch_dagster.defs.eta import queue_eta_sensor
        from batch_dagster.defs.sensors import api_batch_status_sensor

        api_batch_status_sensor(dg.build_sensor_context(instance=self.instance, resources=self.resources))
        queue_eta_sensor(dg.build_sensor_context(instance=self.instance, resources=self.resources))

    def until_delivered(self, sensor: dg.SensorDefinition) -> list[tuple[str, str]]:
        """Run a dropped file's whole life: launch, follow to the end, deliver. All the runs requested."""
        runs = self.tick(sensor)
        self.follow()
        return runs + self.tick(sensor)

    def api(self, stack: ExitStack) -> OpenAI:
        """The REST API over this daemon's store, served until `stack` closes; an openai SDK client for it."""
        from openai import DefaultHttpxClient, OpenAI

        from batch_dagster.api.app import create_app

        config = replace(Settings.from_env(), api_keys=(), database_url=self.db_url, data_dir=self.data_dir,
                         storage_url=self.storage_url or str(self.data_dir), max_upload_bytes=1 << 20)
        server = stack.enter_context(ApiServer(create_app(config)))
        return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                      http_client=DefaultHttpxClient(verify=tls()))


def s3_lines(client, key: str) -> list[dict]:
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def s3_json(client, key: str) -> dict:
    return json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


# `python -m batch_dagster.serve` started by a test, with the project's dagster.yaml: the API, the real Dagster
# daemon (sensors, run queue, run retries, backfills) and optionally the UI, plus their processes.

SERVE_API_KEY = "sk-harness"


def serve_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment for serve in `tmp_path`: none of the caller's BATCH_/DAGSTER_ settings, the shared models."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCH_", "DAGSTER_"))}
    # No warm fleet unless a test asks for one: most serve tests are about the run process's own engine.
    return env | {"DAGSTER_HOME": str(tmp_path / "dagster_home"), "BATCH_DATA_DIR": str(tmp_path / "data"),
                  "BATCH_MODEL_CACHE": str(MODEL_CACHE), "BATCH_FLEET_REPLICAS": "0"} | extra


class Serve:
    """serve in `tmp_path` (its DAGSTER_HOME links the package's dagster.yaml); `module` replaces the project's
    definitions (a workspace.yaml in the working directory points the daemon at it)."""

    def __init__(self, tmp_path: Path, *, module: str | None = None, ui: bool = False, **env: str):
        self.tmp_path, self.module, self.ui = tmp_path, module, ui
        self.home, self.data_dir = tmp_path / "dagster_home", tmp_path / "data"
        self.api_port, self.ui_port, self.metrics_port = free_port(), free_port(), free_port()
        self.env = serve_env(tmp_path, BATCH_API_KEYS=SERVE_API_KEY, **env)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Serve:
        if self.module:
            (self.tmp_path / "workspace.yaml").write_text(
                f"load_from:\n  - python_module:\n      module_name: {self.module}\n"
                f"      working_directory: {REPO}\n      location_name: tests\n")
        self.log = open(self.tmp_path / "serve.log", "w")
        command = [sys.executable, "-m", "batch_dagster.serve", "--port", str(self.api_port), "--metrics-port",
                   str(self.metrics_port)]
        command += ["--dagster-port", str(self.ui_port)] if self.ui else ["--no-ui"]
        self.proc = subprocess.Popen(command, cwd=self.tmp_path, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(f"http://127.0.0.1:{self.api_port}/health", 60, self.proc)
            if self.ui:
                wait_http(f"{self.ui_url}/server_info", 120, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """Ctrl-C, as in a terminal; whatever is left after that is killed, so no test leaks processes."""
        import psutil

        descendants = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        if self.proc.poll() is None:  # serve stops on its own when one of its children dies
            os.kill(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}"

    def logs(self, tail: int = 4000) -> str:
        self.log.flush()
        return (self.tmp_path / "serve.log").read_text()[-tail:]

    def client(self) -> OpenAI:
        from openai import OpenAI

        return OpenAI(base_url=f"http://127.0.0.1:{self.api_port}/v1", api_key=SERVE_API_KEY, max_retries=0,
                      timeout=30)

    def create_batch(self, rows: list[dict], name: str = "in.jsonl"):
        client = self.client()
        with open(write_jsonl(self.tmp_path / name, rows), "rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

    def wait_for(self, batch_id: str, statuses: set[str], timeout_s: float):
        client, deadline = self.client(), time.time() + timeout_s
        while (batch := client.batches.retrieve(batch_id)).status not in statuses:
            if time.time() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"{batch_id} is still {batch.status}\n{self.logs()}")
            time.sleep(0.5)
        return batch

    def settings(self) -> Settings:
        """The settings serve reads from its environment."""
        import pytest

        with pytest.MonkeyPatch.context() as env:
            for name in os.environ.keys() - self.env.keys():
                env.delenv(name)
            for name, value in self.env.items():
                env.setenv(name, value)
            return Settings.from_env()

    @contextmanager
    def store(self) -> Iterator[Session]:
        """A session on serve's metadata store (its BATCH_DATABASE_URL, or that setting's default), read from the
        test."""
        from batch_dagster.db import Database

        database = Database(self.settings().database_url)
        try:
            with database.session() as session:
                yield session
        finally:
            database.dispose()

    @contextmanager
    def instance(self):
        """The Dagster instance the daemon writes to, read from the test."""
        saved = os.environ.get("DAGSTER_HOME")
        os.environ["DAGSTER_HOME"] = str(self.home)
        try:
            with dg.DagsterInstance.from_config(str(self.home)) as instance:
                yield instance
        finally:
            if saved is None:
                os.environ.pop("DAGSTER_HOME", None)
            else:
                os.environ["DAGSTER_HOME"] = saved

    def engine_holder(self) -> tuple[psutil.Process, psutil.Process] | None:
        """The process holding a vLLM engine (a run worker: batch_job runs its steps in it) and that engine's
        core process (its child named VLLM::EngineCore), if any."""
        import psutil

        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                core = next((c for c in p.children() if c.name().startswith("VLLM::EngineCor")), None)
            except psutil.NoSuchProcess:
                continue
            if core is not None:
                return p, core
        return None


def wait_until(predicate, timeout_s: float, serve: Serve | None = None, what: str = ""):
    """predicate()'s first true value, polled (while serve runs); serve's log in the error if it never comes."""
    deadline = time.time() + timeout_s
    while not (value := predicate()):
        if time.time() > deadline or (serve is not None and serve.proc.poll() is not None):
            raise TimeoutError(f"{what}\n{serve.logs() if serve else ''}")
        time.sleep(0.05)
    return value


def batch_runs(instance: dg.DagsterInstance, batch_id: str, timeout_s: float = 60) -> list[dg.DagsterRun]:
    """The batch's runs, oldest first, once the newest has finished (the API's batch ends a little before)."""
    deadline = time.time() + timeout_s
    while True:
        runs = instance.get_runs(dg.RunsFilter(job_name="batch_job", tags={"dagster/partition": batch_id}))
        if (runs and runs[0].is_finished) or time.time() > deadline:
            return list(reversed(runs))
        time.sleep(0.5)


def step_events(instance: dg.DagsterInstance, run_id: str, event_type: dg.DagsterEventType, step_key: str) -> list:
    records = instance.get_records_for_run(run_id, of_type=event_type).records
    return [r for r in records if r.event_log_entry.step_key == step_key]


def materialization_metadata(instance: dg.DagsterInstance, run_id: str, asset: str) -> dict:
    for record in instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records:
        materialization = record.event_log_entry.asset_materialization
        if materialization.asset_key == dg.AssetKey(asset):
            return {k: v.value for k, v in materialization.metadata.items()}
    raise KeyError(f"{asset} was not materialized in run {run_id}")


def file_stats(paths) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of each file: a rewrite (even atomic, by rename) changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def committed_in(results: Path) -> dict:
    """The committed shards of a local batch folder's results directory."""
    return committed_shards(LocalStorage(results.parent), results.name)


def committed_files(results: Path) -> list[Path]:
    """Every file of the committed shards of a local results directory (output, errors, commit marker)."""
    return [results.parent / key for i in sorted(committed_in(results)) for key in shard_keys(results.name, i)]


def local_file(folder, key: str) -> Path:
    """The local file of a key of a batch folder on local disk."""
    return folder.storage.local_path(key)


def answer_text(body: dict) -> str:
    """The text an answer's body holds: its output messages' (Responses), else its first choice's message (chat) or
    text (completions)."""
    if body.get("object") == "response":
        return "".join(part.get("text", "") for item in body["output"] if item["type"] == "message"
                       for part in item["content"])
    choice = body["choices"][0]
    return (choice["message"]["content"] or "") if "message" in choice else choice["text"]


def file_lines(client, file_id: str, merged: bool = False) -> list[dict]:
    """The lines of a file through the API; `merged` asks for a retry batch's merged results (an extension)."""
    if merged:
        text = client.get(f"/files/{file_id}/content", cast_to=str, options={"params": {"merged": "true"}})
        text = text if isinstance(text, str) else text.text
    else:
        text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def check_batch_filters(database) -> None:
    """The list filters on a store (SQLite or PostgreSQL): status, metadata pairs (keys with JSON-path
    characters too), creation time in [after, before), one owner's rows only, `after` paging over the matches."""
    from batch_dagster.db import BatchRecord, FileRecord, repo

    odd = 'a"b.c[0] $ü\\'
    rows = [("batch_1", "a", "completed", 100, {"team": "red", odd: "1"}),
            ("batch_2", "a", "failed", 200, {"team": "red"}),
            ("batch_3", "a", "completed", 300, {"team": "blue", odd: "1"}),
            ("batch_4", "b", "completed", 300, {"team": "red", odd: "1"}),
            ("batch_5", "a", "completed", 400, None)]
    with database.session() as s:
        repo.ensure_owners(s, ["a", "b"])
        s.add_all(FileRecord(id=f"file-{o}", owner=o, bytes=0, created_at=0, expires_at=None, filename="in.jsonl",
                             purpose="batch", path=f"files/{o}") for o in ("a", "b"))
        s.add_all(BatchRecord(id=i, owner=o, endpoint="/v1/chat/completions", input_file_id=f"file-{o}",
                              completion_window="24h",
                              status=st, created_at=t, meta=m, request_total=0, request_completed=0, request_failed=0)
                  for i, o, st, t, m in rows)
        s.commit()

        def ids(limit=10, after=None, **where) -> list[str]:
            page = repo.list_batches(s, "a", after=after, limit=limit, where=repo.BatchFilter(**where))
            assert page is not None
            return [b.id for b in page[0]]

        assert ids() == ["batch_5", "batch_3", "batch_2", "batch_1"]
        assert ids(status="completed") == ["batch_5", "batch_3", "batch_1"]
        assert ids(metadata={"team": "red"}) == ["batch_2", "batch_1"]
        assert ids(metadata={"team": "red", odd: "1"}) == ["batch_1"]
        assert ids(metadata={odd: "1"}) == ["batch_3", "batch_1"]
        assert ids(metadata={"team": "green"}) == [] and ids(metadata={"team": "re"}) == []
        assert ids(created_after=200, created_before=400) == ["batch_3", "batch_2"]
        assert ids(status="completed", metadata={"team": "red"}, created_after=100) == ["batch_1"]
        assert ids(limit=1, after="batch_5", status="completed") == ["batch_3"]  # paging over the matches

    if database.engine.dialect.name == "postgresql":
        # A metadata filter is one the GIN index (ix_batches_metadata) answers, not a scan of the key's history:
        # with sequential scans priced out (as on a table of a year's batches), the plan reads it.
        from sqlalchemy import select

        query = select(BatchRecord.id).where(*repo.BatchFilter(metadata={"team": "green"}).where("postgresql"))
        with database.engine.connect() as connection:
            compiled = query.compile(dialect=connection.dialect)
            params = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in compiled.params.items()}
            connection.exec_driver_sql("SET enable_seqscan = off")
            plan = "\n".join(row[0] for row in connection.exec_driver_sql(f"EXPLAIN {compiled}", params))
        assert "ix_batches_metadata" in plan, plan


def check_retention_queries(database) -> None:
    """The retention queries on a store (SQLite or PostgreSQL): ended batches by their end (the timestamp of their
    terminal status), then pk, after a cursor; the folder files a File still serves; the first batch's creation."""
    from batch_dagster.batchfile.folder import BatchFolder
    from batch_dagster.batchfile.storage import Storage
    from batch_dagster.db import BatchRecord, FileRecord, repo
    from batch_dagster.features.retention import ended_before, first_created_at, served_keys

    # (id, status, created_at, its timestamps): a later completed_at does not count for a failed batch.
    rows = [("batch_r1", "completed", 10, {"completed_at": 100}),
            ("batch_r2", "failed", 20, {"failed_at": 50, "completed_at": 500}),
            ("batch_r3", "expired", 30, {"expired_at": 100}),
            ("batch_r4", "cancelled", 40, {"cancelling_at": 90, "cancelled_at": 300}),
            ("batch_r5", "in_progress", 50, {"in_progress_at": 60}),
            ("batch_r6", "cancelling", 60, {"cancelling_at": 70})]
    with database.session() as s:
        assert first_created_at(s) is None
        repo.ensure_owners(s, ["a"])
        s.add(FileRecord(id="file-r", owner="a", bytes=0, created_at=0, expires_at=None, filename="in.jsonl",
                         purpose="batch", path="files/r"))
        s.add_all(BatchRecord(id=i, owner="a", endpoint="/v1/chat/completions", input_file_id="file-r",
                              completion_window="24h", status=st, created_at=t, request_total=0, request_completed=0,
                              request_failed=0, **at) for i, st, t, at in rows)
        s.commit()
        pks = {b.id: b.pk for b in s.query(BatchRecord)}

        def ids(cutoff=10_000, **kw) -> list[tuple[str, int]]:
            return [(e.batch_id, e.ended_at) for e in ended_before(s, cutoff, **kw)]

        assert ids() == [("batch_r2", 50), ("batch_r1", 100), ("batch_r3", 100), ("batch_r4", 300)]
        assert ids(200) == [("batch_r2", 50), ("batch_r1", 100), ("batch_r3", 100)]
        assert ids(limit=2) == [("batch_r2", 50), ("batch_r1", 100)]
        assert ids(after=(100, pks["batch_r1"])) == [("batch_r3", 100), ("batch_r4", 300)]  # a tie: by pk
        assert ids(after=(300, pks["batch_r4"])) == [] and ids(49) == []
        assert first_created_at(s) == 10

        folder = BatchFolder(cast(Storage, None), "batch_r1")
        now = repo.now()
        s.add_all([FileRecord(id=f"file-r{n}", owner="a", bytes=0, created_at=0, expires_at=expires, filename="x",
                              purpose="batch_output", path=path, batch_id="batch_r1")
                   for n, path, expires in ((1, folder.output_key, None), (2, folder.error_key, now - 1),
                                            (3, folder.input_key, now + 3600))])
        s.commit()
        assert served_keys(s, folder) == {folder.output_key, folder.input_key}  # the expired error file is not


# Table batches (the TableBatchComponent): a project's defs folder, an engine that answers in JSON, the resources.

SCHEMA = {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative"]},
                                           "confidence": {"type": "number"}, "topic": {"type": "string"}},
          "required": ["sentiment", "confidence", "topic"]}
REVIEWS_ROWS = {"review_id": [f"r{i}" for i in range(8)], "stars": [5, 1, 4, 2, 5, 1, 3, 4],
                "text": [f"review number {i} about the kettle" for i in range(8)]}


def reviews_frame():
    """Eight reviews as a pandas DataFrame (pandas imported here: importing this module stays cheap)."""
    import pandas as pd

    return pd.DataFrame(REVIEWS_ROWS)


@dataclass
class LabelEngine:
    """Answers a chat request with JSON from its user message: positive above 3 stars (30 prompt and 12 completion
    tokens each); counts what it ran."""

    crash_times: int = 0
    ran: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    def run(self, endpoint: str, requests: Sequence[tuple[str, dict]], on_progress=None) -> list[dict]:
        if self.crash_times:
            self.crash_times -= 1
            raise EngineCrash("fake engine died")
        lines = []
        for cid, body in requests:
            self.ran.append(cid)
            user = body["messages"][-1]["content"]
            self.prompts.append(user)
            stars = int(re.search(r"(\d) stars", user).group(1))
            text = orjson.dumps({"sentiment": "positive" if stars > 3 else "negative", "confidence": stars / 5,
                                 "topic": "kettle"}).decode()
            if "cut me" in user:
                text, finish = text[:20], "length"
            else:
                finish = "stop"
            lines.append(c.success_line(cid, label_body(body["model"], text, finish)))
            if on_progress is not None:
                on_progress(1)
        return lines


def label_body(model: str, text: str, finish: str, prompt_tokens: int = 30, completion_tokens: int = 12) -> dict:
    """A chat.completion response body as an OpenAI-compatible server writes one (built here, not by the engine's
    code: the fake stands for the engine)."""
    return {"id": f"chatcmpl-{os.urandom(8).hex()}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                         "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def component_yaml(**attributes) -> dict:
    base = {"asset": {"key": "review_labels", "group_name": "reviews"}, "upstream": "reviews",
            "key_columns": ["review_id"],
            "request": {"model": "smollm2-135m-instruct", "system": "Label the review as JSON.",
                        "user": "Review ({stars} stars): {text}", "params": {"temperature": 0, "max_tokens": 40},
                        "json_schema": SCHEMA}}
    return {"type": "batch_dagster.components.TableBatchComponent", "attributes": {**base, **attributes}}


UPSTREAMS = '''
import dagster as dg
import pandas as pd

TABLES = {}  # the tests set what each asset returns


@dg.asset
def reviews() -> pd.DataFrame:
    return TABLES["reviews"]


@dg.asset(partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01"))
def tickets(context: dg.AssetExecutionContext) -> pd.DataFrame:
    return TABLES[context.partition_key]
'''


@contextmanager
def table_project(*components: dict):
    """A dg project's defs folder: the upstream tables (tables.py) and each component in a folder of its own."""
    import importlib

    import yaml
    from dagster.components.testing import create_defs_folder_sandbox

    with create_defs_folder_sandbox() as sandbox:
        (sandbox.defs_folder_path / "tables.py").write_text(UPSTREAMS)
        for number, body in enumerate(components):
            folder = sandbox.defs_folder_path / f"labels_{number}"
            folder.mkdir()
            (folder / "defs.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
        with sandbox.build_component_tree() as tree:
            tables = importlib.import_module(f"{sandbox.project_name}.defs.tables").TABLES
            yield tree.build_defs(), tables


def table_resources(data_dir: Path, engine: Any, name: str, **pipeline) -> dict:
    return {STORAGE: StorageResource(data_dir=str(data_dir)), PIPELINE: PipelineConfig(shard_size=3, **pipeline),
            VLLM: fake_vllm(name, engine), IO_MANAGER: TableIOManager(data_dir=str(data_dir))}


def materialize(defs: dg.Definitions, keys: list[str], res: dict, instance, partition: str | None = None,
                raise_on_error: bool = True) -> dg.ExecuteInProcessResult:
    wanted = {dg.AssetKey(k) for k in keys}  # the definitions' own assets, not yet bound to their resources
    assets = [a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and set(a.keys) & wanted]
    return dg.materialize(assets, resources=res, instance=instance, partition_key=partition,
                          raise_on_error=raise_on_error)


def labels_of(result: dg.ExecuteInProcessResult, key: str = "review_labels") -> tuple[Any, dict]:
    """The answered table (a pandas DataFrame) and its materialization's metadata values."""
    event = result.asset_materializations_for_node(key.replace("/", "__"))[0]
    return result.output_for_node(key.replace("/", "__")), {k: v.value for k, v in event.metadata.items()}


