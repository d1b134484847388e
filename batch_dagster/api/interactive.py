"""The interactive endpoints beside the batch ones, so that one base URL serves both: /v1/models lists the registry's
models, and /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/responses are forwarded to the model's
warm fleet (its vllm-router), under the caller's key, with its owner's cache_salt, within its key's calls in flight.

The router's answer is passed on as it comes: its status, the headers that describe it, and its body's bytes chunk by
chunk (a stream's events as the router sends them), never parsed and written again. Calls are counted by key and
model on the operator's metrics listener (api/metrics.py)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from batch_dagster.batchfile.registry import ModelSpec, load_registry
from batch_dagster.db.keys import Caller
from batch_dagster.db.metrics import OTHER
from batch_dagster.features.interactive import (
    ENDPOINTS,
    Fleets,
    InFlight,
    Unavailable,
    UsageTail,
    not_isolated,
    prefix_cached,
    route,
    salted_body,
    too_many,
    unknown_model,
    unsalted_refused,
)

from .context import AppContext
from .errors import ERROR_RESPONSES, error_response

log = logging.getLogger("batch_dagster.api.interactive")
CONNECT_S = 5.0  # a router on the same network answers a connection at once
ANSWER_S = 1800.0  # between two chunks of an answer at most: the router's own --request-timeout-secs (serve/fleet.py)
# The router's answer's headers a client reads; hop-by-hop ones, the server's own and the router's CORS are not.
PASSED_HEADERS = ("content-type", "content-length", "x-request-id", "retry-after")
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
NAMESPACE = "batch_dagster"

router = APIRouter(tags=["models"])


class Model(BaseModel):
    """A registry model, as OpenAI's Model object, with two extensions: the state of its warm fleet (`warm`,
    `starting`, `asleep`, `failed`; null: none, so interactive calls of it answer 503) and its endpoints."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batch-dagster"
    fleet: str | None = None
    endpoints: list[str] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class CallMetrics:
    """Interactive calls by key and model, counted in this process (calls leave nothing in the store): their
    answers' statuses, those in flight, their durations and the tokens their answers report."""

    def __init__(self, registry: CollectorRegistry):
        self.calls = Counter(f"{NAMESPACE}_interactive_calls", "Interactive calls answered, by key, model, endpoint "
                             "and HTTP status (the router's, or the API's own refusal).",
                             ["key", "model", "endpoint", "status"], registry=registry)
        self.in_flight = Gauge(f"{NAMESPACE}_interactive_in_flight", "Interactive calls in flight, by key and model.",
                               ["key", "model"], registry=registry)
        self.first_byte = Histogram(f"{NAMESPACE}_interactive_first_byte_seconds", "Seconds from a forwarded call to "
                                    "the first bytes of its answer's body (a stream's first event).",
                                    ["model", "endpoint"], buckets=SECONDS_BUCKETS, registry=registry)
        self.seconds = Histogram(f"{NAMESPACE}_interactive_call_seconds", "Seconds from a forwarded call to the end of "
                                 "its answer.", ["model", "endpoint"], buckets=SECONDS_BUCKETS, registry=registry)
        self.tokens = Counter(f"{NAMESPACE}_interactive_tokens", "Tokens of interactive calls, as their answers report "
                              "them (streams when they ask `stream_options.include_usage`): `input` and `output`.",
                              ["key", "model", "kind"], registry=registry)


@dataclass
class Interactive:
    """What the interactive endpoints share: the registry, the fleets' states, the calls in flight, a connection pool
    to the routers, and the metrics."""

    context: AppContext
    registry: dict[str, ModelSpec]
    created: int  # the registry file's time: what /v1/models says its models were created at
    fleets: Fleets
    metrics: CallMetrics
    in_flight: InFlight = field(default_factory=InFlight)
    prefix_cached: dict[str, bool] = field(default_factory=dict)  # by router: whether its servers keep a prefix cache
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(
        timeout=httpx.Timeout(ANSWER_S, connect=CONNECT_S), limits=httpx.Limits(max_connections=None)))

    def model_label(self, model: object) -> str:
        return model if isinstance(model, str) and model in self.registry else OTHER


def install(app: FastAPI, context: AppContext) -> None:
    """Serve the interactive endpoints on `app`, their metrics in its metrics registry (metrics.install first)."""
    path = context.config.models_file
    try:
        registry, created = load_registry(path), int(path.stat().st_mtime)
    except (OSError, ValueError) as exc:  # the batch endpoints still serve; every model is unknown here
        log.warning("interactive calls: the model registry %s could not be read (%r): no model is served", path, exc)
        registry, created = {}, 0
    app.state.interactive = Interactive(context, registry, created, Fleets(context.db, context.config.fleet_urls),
                                        CallMetrics(app.state.metrics))
    app.include_router(router, prefix="/v1")
    for endpoint in ENDPOINTS:
        app.add_api_route(endpoint, forward, methods=["POST"], include_in_schema=False)


async def close(app: FastAPI) -> None:
    await app.state.interactive.client.aclose()


def _of(request: Request) -> Interactive:
    return request.app.state.interactive


@router.get("/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    """The registry's models, each with its warm fleet's state."""
    calls = _of(request)
    fleets = await run_in_threadpool(calls.fleets.current)
    return ModelList(data=[_model(calls, name, fleets) for name in calls.registry])


@router.get("/models/{model:path}", response_model=Model, responses=ERROR_RESPONSES)
async def retrieve_model(model: str, request: Request) -> Model | Response:
    calls = _of(request)
    if model not in calls.registry:
        return _refusal(unknown_model(model))
    return _model(calls, model, await run_in_threadpool(calls.fleets.current))


def _model(calls: Interactive, name: str, fleets) -> Model:
    fleet = fleets.get(name)
    return Model(id=name, created=calls.created, fleet=fleet.state if fleet else None,
                 endpoints=list(calls.registry[name].endpoints))


async def forward(request: Request) -> Response:
    """A call forwarded to its model's router, its answer passed on as the router sends it."""
    calls, caller = _of(request), request.state.caller
    endpoint = request.scope["route"].path
    started = time.perf_counter()
    body = await request.body()  # bounded by the guard (BATCH_MAX_JSON_BODY_BYTES)
    payload = _payload(body)
    if isinstance(payload, Response):
        return _counted(calls, caller, OTHER, endpoint, payload)
    model = payload["model"]
    try:
        fleet = route(model, calls.registry, await run_in_threadpool(calls.fleets.current), time.time())
    except Unavailable as exc:
        if exc.code == "fleet_not_warm":
            await _called(calls, model)  # a sleeping fleet wakes for it
        return _counted(calls, caller, calls.model_label(model), endpoint, _refusal(exc))
    config = calls.context.config
    if unsalted_refused(endpoint, config.shared_owners) and await _prefix_cached(calls, fleet.url):
        return _counted(calls, caller, model, endpoint, _refusal(not_isolated(model, endpoint)))
    limit = config.key_max_interactive_calls
    if not calls.in_flight.take(caller.owner, limit):
        return _counted(calls, caller, model, endpoint, _refusal(too_many(limit or 0)))
    try:
        await _called(calls, model)
        sent = json.dumps(salted_body(payload, caller, config.shared_owners, config.cache_salt_secret)).encode()
        answer = await _send(calls, fleet.url + endpoint, sent)
    except BaseException:
        calls.in_flight.give_back(caller.owner)
        raise
    if isinstance(answer, Response):
        calls.in_flight.give_back(caller.owner)
        return _counted(calls, caller, model, endpoint, answer)
    return Relayed(answer, _Call(calls, caller, model, endpoint, started))


def _payload(body: bytes) -> dict[str, Any] | Response:
    """The call's JSON object, or the 400 OpenAI answers to a body that is not one or names no model."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return error_response(400, "We could not parse the JSON body of your request: it is not valid JSON.",
                              code="invalid_json")
    if not isinstance(payload, dict):
        return error_response(400, "The request body must be a JSON object.", code="invalid_json")
    if not isinstance(payload.get("model"), str) or not payload["model"]:
        return error_response(400, "You must provide a model parameter.", param="model", code="missing_model")
    return payload


async def _called(calls: Interactive, model: str) -> None:
    try:
        await run_in_threadpool(calls.fleets.called, model)
    except Exception as exc:  # the call goes on; the fleet's idle clock reads the next one
        log.warning("could not record an interactive call of %s: %r", model, exc)


async def _prefix_cached(calls: Interactive, url: str) -> bool:
    """Whether the servers behind the router at `url` keep a prefix cache: a replica the router lists is asked (its
    /metrics), once per router; while none can be asked, taken as yes."""
    if (known := calls.prefix_cached.get(url)) is not None:
        return known
    try:
        listed = await calls.client.get(url + "/list_workers", timeout=CONNECT_S)
        urls = listed.json().get("urls") if listed.status_code == 200 else None
        server = str(urls[0]).rstrip("/") if isinstance(urls, list) and urls else url
        answer = await calls.client.get(server + "/metrics", timeout=CONNECT_S)
        answer.raise_for_status()
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.warning("could not ask the servers behind %s whether they keep a prefix cache: %r", url, exc)
        return True
    calls.prefix_cached[url] = found = prefix_cached(answer.text)
    return found


async def _send(calls: Interactive, url: str, body: bytes) -> httpx.Response | Response:
    """The router's answer, its body not read yet; a 503 of our own when the router cannot be reached."""
    headers = {"content-type": "application/json", "accept-encoding": "identity"}  # raw bytes are the body's bytes
    if calls.context.config.vllm_api_key:
        headers["authorization"] = f"Bearer {calls.context.config.vllm_api_key}"  # never the caller's key
    try:
        return await calls.client.send(calls.client.build_request("POST", url, content=body, headers=headers),
                                       stream=True)
    except httpx.HTTPError as exc:
        log.warning("interactive call: the router at %s did not answer: %r", url, exc)
        return _refusal(Unavailable(503, "The model's warm fleet did not answer (its router may be restarting); "
                                    "retry shortly.", "fleet_unreachable", type="server_error", retry_after_s=2))


def _refusal(exc: Unavailable) -> Response:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code, headers=headers)


def _counted(calls: Interactive, caller: Caller, model: str, endpoint: str, response: Response) -> Response:
    calls.metrics.calls.labels(caller.name, model, endpoint, str(response.status_code)).inc()
    return response


@dataclass
class _Call:
    """A forwarded call until its answer ends: counted in flight, then by its status, duration and tokens."""

    calls: Interactive
    caller: Caller
    model: str
    endpoint: str
    started: float
    usage: UsageTail = field(default_factory=UsageTail)

    def __post_init__(self) -> None:
        self.calls.metrics.in_flight.labels(self.caller.name, self.model).inc()

    def first_bytes(self) -> None:
        self.calls.metrics.first_byte.labels(self.model, self.endpoint).observe(time.perf_counter() - self.started)

    def ended(self, status: int) -> None:
        m, key = self.calls.metrics, self.caller.name
        self.calls.in_flight.give_back(self.caller.owner)
        m.in_flight.labels(key, self.model).dec()
        m.calls.labels(key, self.model, self.endpoint, str(status)).inc()
        m.seconds.labels(self.model, self.endpoint).observe(time.perf_counter() - self.started)
        if (used := self.usage.usage()) is not None:
            m.tokens.labels(key, self.model, "input").inc(used[0])
            m.tokens.labels(key, self.model, "output").inc(used[1])


class Relayed(StreamingResponse):
    """The router's answer, relayed chunk by chunk as it arrives. However it ends (done, the client gone, the server
    stopping), the router's connection is closed (which aborts the request on the servers) and the call is counted."""

    def __init__(self, upstream: httpx.Response, call: _Call):
        self.upstream, self.call = upstream, call
        headers = {name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers}
        super().__init__(self._chunks(), status_code=upstream.status_code, headers=headers)

    async def _chunks(self):
        first = True
        try:
            async for chunk in self.upstream.aiter_raw():
                if first:
                    self.call.first_bytes()
                    first = False
                self.call.usage.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:  # the answer's status is sent: the stream can only end short
            log.warning("interactive call of %s: the router's answer broke off: %r", self.call.model, exc)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.call.ended(self.upstream.status_code)
