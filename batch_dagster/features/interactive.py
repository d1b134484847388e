"""Interactive calls, forwarded to a model's warm fleet: where a call may go (its model's router, never an address a
client names), why it may not go (no such model, no warm fleet), the cache_salt its owner's requests carry, the calls
each key has in flight, and the tokens an answer says it used."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.db import Database
from batch_dagster.db.fleets import fleet_records, record_call
from batch_dagster.db.keys import UNNAMED, Caller
from batch_dagster.features.scope import EVERYONE, Owner, salted, scope

log = logging.getLogger(__name__)
# What the API forwards, each to the same path on the model's router.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
NO_FLEET_RETRY_S = 10  # Retry-After when no fleet is on its way: short, since only the operator can start one
LOOK_AGAIN_S = 1.0  # how long this process goes by the fleets' states it read from the store
RECORD_CALL_EVERY_S = 5.0  # the store is told a model's fleet was called at most this often (by one process)
MODEL_CHARS = 64  # the most of a client's model name a message repeats


class Unavailable(Exception):
    """A call that cannot be forwarded: its HTTP status, its message and code in OpenAI's error shape, and how soon
    to try again (Retry-After) when it may work later."""

    def __init__(self, status: int, message: str, code: str, *, type: str = "invalid_request_error",
                 param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type
        self.param, self.retry_after_s = param, retry_after_s


@dataclass(frozen=True)
class Fleet:
    """A model's fleet as the API sees it: its router's base URL (without /v1), its state (serve's `warm`,
    `starting`, `asleep`, `failed`; a router named in BATCH_FLEET_URLS is taken as warm), how long its last start
    took, when its state last changed (unix seconds), and whether serve runs it (then calls are recorded for it)."""

    url: str
    state: str = "warm"
    start_s: float | None = None
    changed_at: float = 0.0
    served: bool = False

    def retry_after_s(self, now: float) -> int:
        """Seconds until its replicas should answer: its last start's duration, less what it has spent starting."""
        took = self.start_s or NO_FLEET_RETRY_S
        left = took if self.state == "asleep" else took - (now - self.changed_at)
        return max(math.ceil(left), 1)


def shown_model(model: str) -> str:
    """A client's model name as a message repeats it: short, and printable."""
    short = model[:MODEL_CHARS] + ("…" if len(model) > MODEL_CHARS else "")
    return short.encode("utf-8", "backslashreplace").decode("utf-8")


def unknown_model(model: str) -> Unavailable:
    return Unavailable(404, f"The model `{shown_model(model)}` does not exist or you do not have access to it.",
                       "model_not_found")


def route(model: str, registry: Mapping[str, ModelSpec], fleets: Mapping[str, Fleet], now: float) -> Fleet:
    """The fleet a call of `model` goes to; Unavailable when the registry has no such model (404, as OpenAI's), or
    when the model has no warm fleet (503 with Retry-After, and how to start one)."""
    if model not in registry:
        raise unknown_model(model)
    fleet = fleets.get(model)
    if fleet is not None and fleet.state == "warm":
        return fleet
    if fleet is not None and fleet.state in ("starting", "asleep"):
        wait = fleet.retry_after_s(now)
        why = "was asleep (no work for BATCH_FLEET_IDLE_S) and starts again now" if fleet.state == "asleep" \
            else "is starting"
        raise Unavailable(503, f"The warm fleet of {model} {why}: retry in about {wait} s.", "fleet_not_warm",
                          type="server_error", retry_after_s=wait)
    how = (f"list it in BATCH_FLEET_MODELS for `make serve` (python -m batch_dagster.serve), or start one with "
           f"`batch-dagster fleet {model}` and name its router in BATCH_FLEET_URLS ({model}=http://HOST:PORT). Its "
           "batches run all the same.")
    failed = " (its fleet failed to start: see serve's log)" if fleet is not None else ""
    raise Unavailable(503, f"No warm fleet serves {model}{failed}, and interactive calls are answered by a model's "
                      f"warm fleet. To start one, {how}", "no_warm_fleet", type="server_error",
                      retry_after_s=NO_FLEET_RETRY_S)


def owner_of(caller: Caller) -> Owner:
    """The caller as its batches' owner: named as its key is (an unnamed key by its owner), so that the operator's
    BATCH_SHARED_OWNERS shares its interactive calls' cached prefixes exactly as its batches'."""
    return Owner(caller.owner, caller.name if caller.name != UNNAMED else caller.owner)


def salted_body(body: dict[str, Any], caller: Caller, shared: tuple[str, ...], secret: str) -> dict[str, Any]:
    """The body with its owner's cache_salt (over the body's own, if any), as every batch line gets it: a prefix-cache
    hit never crosses owners through the interactive path either. A body whose own cache_salt vLLM would refuse keeps
    it, and vLLM refuses it."""
    where = scope(owner_of(caller), shared, batch_id="")
    [(_, out)] = salted([("", body)], where, secret)
    return out


# vllm-router (0.1.17) re-types an embeddings request and drops vLLM's own fields, cache_salt among them.
UNSALTED = ("/v1/embeddings",)
# vLLM's CacheConfig on its /metrics, as an info gauge whose labels are the config's fields.
_PREFIX_CACHED = re.compile(r'^vllm:cache_config_info\{[^}]*enable_prefix_caching="True"', re.MULTILINE)


def prefix_cached(metrics: str) -> bool:
    """Whether a vLLM server keeps a prefix cache, from its /metrics text."""
    return _PREFIX_CACHED.search(metrics) is not None


def unsalted_refused(endpoint: str, shared: tuple[str, ...]) -> bool:
    """Whether a call of `endpoint` must not reach servers that keep a prefix cache: its cache_salt does not reach
    them (the router drops it), so cached prefixes would cross keys, unless the operator shares them among all."""
    return endpoint in UNSALTED and EVERYONE not in shared


def not_isolated(model: str, endpoint: str) -> Unavailable:
    return Unavailable(400, f"Interactive {endpoint} calls of {model} are not served: its servers keep a prefix cache, "
                       "and the fleet's router (vllm-router) drops the cache_salt that keeps each key's part of it "
                       "apart. Send them in a batch; or the operator turns the model's prefix cache off "
                       "(enable_prefix_caching = false in its registry entry) or shares it (BATCH_SHARED_OWNERS=*).",
                       "prefix_cache_not_isolated", param="model")


class Fleets:
    """The fleets' states, read from the store (where serve writes them) at most every LOOK_AGAIN_S, over the routers
    BATCH_FLEET_URLS names; and the calls each model's fleet gets, written to the store (serve keeps a fleet in use
    warm, and wakes one that sleeps). Blocking: the API calls it in a worker thread."""

    def __init__(self, db: Database, fleet_urls: Mapping[str, str]):
        self.db, self.fleet_urls = db, dict(fleet_urls)
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._fleets: dict[str, Fleet] = {}
        self._recorded: dict[str, float] = {}

    def current(self) -> dict[str, Fleet]:
        """The fleets by model; while the store does not answer, those it said last (or BATCH_FLEET_URLS')."""
        with self._lock:
            if time.monotonic() - self._read_at >= LOOK_AGAIN_S:
                fleets = {model: Fleet(url.rstrip("/")) for model, url in self.fleet_urls.items()}
                try:
                    with self.db.session() as session:
                        for model, f in fleet_records(session).items():
                            fleets[model] = Fleet(f.url.rstrip("/"), f.state, f.start_s, f.changed_at, served=True)
                except Exception as exc:  # the store restarting: calls go on where they went
                    log.warning("could not read the fleets' states from the store: %r", exc)
                    fleets = self._fleets or fleets
                self._fleets, self._read_at = fleets, time.monotonic()
            return self._fleets

    def called(self, model: str) -> None:
        """A call wants the model's fleet (one serve runs): told to the store, at most every RECORD_CALL_EVERY_S."""
        with self._lock:
            fleet = self._fleets.get(model)
            if fleet is None or not fleet.served or \
                    time.monotonic() - self._recorded.get(model, -math.inf) < RECORD_CALL_EVERY_S:
                return
            self._recorded[model] = time.monotonic()
        with self.db.session() as session:
            record_call(session, model)


@dataclass
class InFlight:
    """The interactive calls each key has in flight in this process. Taken and given back on the event loop's
    thread, so no lock."""

    held: dict[str, int] = field(default_factory=dict)

    def take(self, owner: str, limit: int | None) -> bool:
        """One more call of `owner`, unless it has `limit` already (None: no limit)."""
        n = self.held.get(owner, 0)
        if limit is not None and n >= limit:
            return False
        self.held[owner] = n + 1
        return True

    def give_back(self, owner: str) -> None:
        left = self.held.pop(owner) - 1
        if left:
            self.held[owner] = left


def too_many(limit: int) -> Unavailable:
    return Unavailable(429, f"This key has {limit} interactive calls in flight already, its limit "
                       "(BATCH_KEY_MAX_INTERACTIVE_CALLS); send the next when one has answered.",
                       "too_many_interactive_calls", type="rate_limit_exceeded", retry_after_s=1)


USAGE_TAIL = 16 * 1024  # the end of an answer where its usage is looked for
_USAGE = b'"usage":'


class UsageTail:
    """The last bytes of an answer as it streams through, and the token usage they carry: a JSON body's `usage`,
    or a stream's last event that has one (a chat or completion stream's last chunk when the client asked
    `stream_options.include_usage`; a Responses stream's `response.completed`)."""

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        self.tail = (self.tail + chunk)[-USAGE_TAIL:]

    def usage(self) -> tuple[int, int] | None:
        """(input tokens, output tokens) of the last usage object in the tail; None when there is none."""
        at = self.tail.rfind(_USAGE)
        if at < 0:
            return None
        try:
            value, _ = json.JSONDecoder().raw_decode(self.tail[at + len(_USAGE):].decode("utf-8", "replace").lstrip())
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        counts = [value.get(name) for name in ("prompt_tokens", "input_tokens", "completion_tokens", "output_tokens")]
        prompt, given, completion, output = (n if isinstance(n, int) and n >= 0 else None for n in counts)
        return (prompt if prompt is not None else given or 0), (completion if completion is not None else output or 0)
