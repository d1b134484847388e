"""The one configuration: every BATCH_* variable, declared once as a field of `Settings`, and the only reader of them.

A declaration holds the variable's default, its meaning and how its text is read. The docs' configuration tables
(`python -m batch_dagster.settings --markdown`), `VARIABLES` and the Dagster resources' fields are derived from it;
a test checks that every variable the code names is declared. Defaults work on a laptop.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import date
from pathlib import Path
from string import Template
from typing import Any

from batch_dagster.batchfile import generated
from batch_dagster.batchfile.contract import Limits
from batch_dagster.batchfile.image_sources import DEFAULT_MAX_BYTES as DEFAULT_MAX_IMAGE_BYTES
from batch_dagster.batchfile.image_sources import ImageSources
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.windows import CompletionWindows
from batch_dagster.features.reuse import DEFAULT_MAX_BYTES as DEFAULT_ANSWER_STORE_BYTES

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "config"
DAY_S = 24 * 3600
DEFAULT_OFFLINE_RUNS = 1
DEFAULT_RUNS_PER_MODEL = 4
LOOPBACK = "127.0.0.1"  # where servers listen unless told otherwise
POLICIES = ("cache_aware", "power_of_two", "round_robin", "random", "consistent_hash")  # vllm-router --policy
VLLM_SERVER_PORT = 8100  # `batch-dagster vllm-server`'s port unless --port


@dataclass(frozen=True)
class Variable:
    """One environment variable: its default, how its text is read, what it means, and the Settings field it fills.

    `default` is the value when the variable is unset: a typed value, or text read as if the variable were set
    to it, after the variables it names (`$BATCH_DATA_DIR/models`) are filled in. `derive` computes a default from the
    variables before it; `default` then describes it for the docs.
    """

    name: str
    default: Any
    meaning: str
    section: str
    parse: Callable[[str], Any] = str
    derive: Callable[[Mapping[str, Any]], Any] | None = None
    secret: bool = False  # a credential: never quoted in a message
    field: str = ""  # the Settings field that holds it (set from the declaration)

    @property
    def text_is_value(self) -> bool:
        """Whether the variable's text, as set, is its value (a Dagster EnvVar can then carry it to a resource)."""
        return self.secret or self.parse in (str, int, Path, _limit)

    def text(self) -> str:
        """The default as the docs show it ("" for none)."""
        if isinstance(self.default, Path):
            return str(self.default.relative_to(PACKAGE_DIR.parent))
        if isinstance(self.default, tuple | list):
            return ",".join(self.default)
        return "" if self.default is None else str(self.default)

    def read(self, earlier: Mapping[str, Any]) -> Any:
        """The value the environment gives (or the default), given the values of the variables before it."""
        raw = _raw(self.name)
        if not raw:
            if self.derive is not None:
                return self.derive(earlier)
            if not isinstance(self.default, str):
                return self.default
            raw = Template(self.default).substitute({k: str(v) for k, v in earlier.items()})
        try:
            return self.parse(raw)
        except ValueError as exc:
            shown = "" if self.secret else f"={raw!r}"  # a secret's value stays out of the message (and the logs)
            raise ValueError(f"{self.name}{shown}: {exc}") from None


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _limit(text: str) -> int | None:
    return int(text) or None  # 0: no limit


def _switch(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError("must be 1 or 0 (true or false, yes or no, on or off)")
    return text.lower() in ("1", "true", "yes", "on")


def _budget(text: str) -> float | None:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a finite number, 0 or more")
    return value or None  # 0: no budget


def _loop_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0.1:  # a loop that never sleeps, or NaN
        raise ValueError("must be 0.1 seconds or more")
    return value


def _rate(text: str) -> float | None:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError("must be a share from 0 to 1")
    return value or None  # 0: no breaker


KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def split_key(entry: str) -> tuple[str | None, str]:
    """An entry of BATCH_API_KEYS as (name, key): `name:key`, or a bare `key` (no name)."""
    name, colon, key = entry.partition(":")
    return (name, key) if colon else (None, entry)


def api_key_entries(text: str) -> tuple[str, ...]:
    """BATCH_API_KEYS' entries, checked: names well formed, no key or name twice."""
    entries = _csv(text)
    names: set[str | None] = set()
    keys: set[str] = set()
    for number, entry in enumerate(entries, 1):  # the messages quote no part of an entry: it may be a key
        name, key = split_key(entry)
        if name is not None and not KEY_NAME.fullmatch(name):
            raise ValueError(f"entry {number}: its key name (before the first ':') must be 1 to 64 letters, "
                             "digits, '.', '_' or '-'")
        if not key or key in keys or (name is not None and name in names):
            raise ValueError(f"entry {number}: {'an empty key' if not key else 'a repeated key or name'}")
        keys.add(key)
        names.add(name)
    return entries


def _windows(text: str) -> tuple[str, ...]:
    entries = _csv(text)
    CompletionWindows.of(entries)  # refuses an entry that is not a window
    return entries


def _allow(text: str) -> tuple[str, ...]:
    from batch_dagster.features.egress import Allow

    entries = _csv(text)
    Allow.parse(entries)  # refuses an entry that is neither a host nor a CIDR
    return entries


def parse_fleet_urls(text: str) -> dict[str, str]:
    """BATCH_FLEET_URLS' `model=url` entries, by model."""
    urls: dict[str, str] = {}
    for number, entry in enumerate(_csv(text), 1):
        model, equals, url = entry.partition("=")
        if not equals or not model.strip() or not url.strip().startswith(("http://", "https://")):
            raise ValueError(f"entry {number} ({entry!r}) is not `model=http(s)://host:port`")
        if model.strip() in urls:
            raise ValueError(f"entry {number} names {model.strip()!r} a second time")
        urls[model.strip()] = url.strip().rstrip("/")
    return urls


def _day(text: str) -> date:
    return date.fromisoformat(text)


def _budget_mode(text: str) -> str:
    if text not in ("fixed", "adaptive"):
        raise ValueError("must be fixed or adaptive")
    return text


def _policy(text: str) -> str:
    if text not in POLICIES:
        raise ValueError(f"not a vllm-router policy; choose one of {', '.join(POLICIES)}")
    return text


def storage_location(data_dir: Path | str, url: str = "") -> tuple[str, Path]:
    """Where batch folders and files live (`url`; empty: `data_dir` itself) and this process's local scratch."""
    return url or str(data_dir), Path(data_dir) / "scratch"


def open_batch_storage(data_dir: Path | str, url: str = "") -> Storage:
    """The store `storage_location` names, opened: every process's one way to its batch folders and files."""
    from batch_dagster.storage import open_storage

    return open_storage(*storage_location(data_dir, url))


def _data(v: Mapping[str, Any]) -> Path:
    return v["BATCH_DATA_DIR"]


_DECLARED = "variable"  # the metadata key of a Settings field's declaration


def variable(name: str, default: Any, section: str, meaning: str, *, parse: Callable[[str], Any] = str,
             derive: Callable[[Mapping[str, Any]], Any] | None = None, secret: bool = False) -> Any:
    """A Settings field filled from the environment variable `name`: the one declaration of a setting."""
    return dataclasses.field(metadata={_DECLARED: Variable(name, default, meaning, section, parse, derive, secret)})


def is_set(name: str) -> bool:
    """Whether the variable has a non-empty value in the environment."""
    return bool(_raw(name))


def _raw(name: str) -> str:
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a documented variable (add it to settings.VARIABLES)")
    return os.environ.get(name, "").strip()


def declared(name: str) -> Variable:
    """The declaration of the variable `name` (KeyError: none)."""
    return _BY_NAME[name]


def is_derived(name: str) -> bool:
    """Whether the variable's default is derived from other variables (it has no value of its own)."""
    variable = _BY_NAME[name]
    return variable.derive is not None or (isinstance(variable.default, str) and "$" in variable.default)


def default(name: str) -> Any:
    """A variable's typed default, for a field that holds it (a resource's, an option's): never a second literal.

    Only for defaults that name no other variable; those are derived where the settings are read."""
    variable = _BY_NAME[name]
    if is_derived(name):
        raise ValueError(f"{name}'s default is derived from other settings: read it from Settings.from_env()")
    return variable.parse(variable.default) if isinstance(variable.default, str) else variable.default


@dataclass(frozen=True)
class Settings:
    """Every setting, typed, as the environment gives it now: one field per environment variable, each declared
    once here with its default, its meaning and how its text is read. The docs' tables (`markdown`), `VARIABLES`
    and the Dagster resources' fields (defs/resources/setting_fields.py) are derived from these declarations."""

    data_dir: Path = variable(
        "BATCH_DATA_DIR", "./data", "Storage",
        "This process's local folder: batch folders, uploaded files and reports (unless BATCH_STORAGE_URL points "
        "elsewhere), scratch, logs and (by default) the SQLite store and the models.",
        parse=lambda t: Path(t).resolve())
    storage_url: str = variable(
        "BATCH_STORAGE_URL", "$BATCH_DATA_DIR", "Storage",
        "Where batch folders, uploaded files and reports live: a local path, or s3://bucket/prefix on any "
        "S3-compatible store (boto3's own AWS_ENDPOINT_URL, AWS_* configure it). Every process of a deployment must "
        "name the same place.", derive=lambda v: storage_location(_data(v))[0])
    model_cache_dir: Path = variable(
        "BATCH_MODEL_CACHE", "$BATCH_DATA_DIR/models", "Storage",
        "Where embedded models are prepared.", parse=Path)
    database_url: str = variable(
        "BATCH_DATABASE_URL", "sqlite:///$BATCH_DATA_DIR/batch-api.db", "Storage",
        "The API's metadata store: any SQLAlchemy URL (e.g. postgresql+psycopg://...).", secret=True)
    models_file: Path = variable(
        "BATCH_MODELS_FILE", CONFIG_DIR / "models.toml", "Models",
        "The model registry.", parse=Path)
    prices_file: Path = variable(
        "BATCH_PRICES_FILE", CONFIG_DIR / "prices.toml", "Models",
        "The price table (per million tokens, batch discount).", parse=Path)
    engine_mode: str = variable(
        "BATCH_ENGINE_MODE", "offline", "Engine",
        "`offline`: vLLM in the run's process; `server`: OpenAI-compatible vLLM servers at BATCH_VLLM_SERVER_URLS.",)
    vllm_server_urls: tuple[str, ...] = variable(
        "BATCH_VLLM_SERVER_URLS", (), "Engine",
        "Comma-separated base URLs of vLLM servers (server mode).", parse=_csv)
    vllm_api_key: str | None = variable(
        "BATCH_VLLM_API_KEY", None, "Engine",
        "The key the vLLM servers expect, if any.", secret=True)
    cache_salt_secret: str = variable(
        "BATCH_CACHE_SALT_SECRET", "", "Engine",
        "Mixed into the salt every request carries to vLLM's prefix cache (its `cache_salt`, one per owner). Set it "
        "(long random text, the same in every process) where the vLLM servers also take requests from elsewhere: "
        "then nobody who reaches them directly can compute an owner's salt. Unset: the salt is a hash of the owner "
        "(an API key's owner is its key's SHA-256).", secret=True)
    vllm_max_concurrency: int = variable(
        "BATCH_VLLM_MAX_CONCURRENCY", 64, "Engine",
        "Requests in flight to the servers at once (server mode).", parse=int)
    vllm_budget: str = variable(
        "BATCH_VLLM_BUDGET", "fixed", "Engine",
        "How many requests a batch keeps in flight on the servers (server mode, a fleet). `fixed`: "
        "BATCH_VLLM_MAX_CONCURRENCY. `adaptive`, for servers that also answer interactive requests: a budget up to "
        "it, recomputed every half second from the servers' own metrics (vLLM's /metrics: requests running and "
        "waiting, time to first token, inter-token latency): down to one at once when other clients' requests "
        "appear, halved when their latencies rise or a server answers 429 or 503, grown again while they keep up "
        "(engine/budget.py).", parse=_budget_mode)
    fleet_replicas: int = variable(
        "BATCH_FLEET_REPLICAS", 1, "Engine",
        "`make serve`: vLLM servers of each warm fleet (each on a core of its own, or on a GPU host on GPUs of its "
        "own) behind its vllm-router; 0: no fleet, every batch runs offline in its run.", parse=int)
    # Empty until asked for (Settings.served_fleet_models): reading the registry is no part of reading the settings.
    fleet_models: tuple[str, ...] = variable(
        "BATCH_FLEET_MODELS", "the registry's first chat model", "Engine",
        "`make serve`: comma-separated registry models (chat and embeddings alike), each given a warm fleet behind a "
        "vllm-router of its own; batches of other models run in their runs' processes.", parse=_csv,
        derive=lambda v: ())
    fleet_port: int = variable(
        "BATCH_FLEET_PORT", 0, "Engine",
        "`make serve` and `batch-dagster fleet`: the first fleet's router port; its replicas take the next ports, then "
        "its router's metrics exporter, and the next fleet the next block. 0: a free block of ports per fleet chosen "
        "at start (logged), so two `serve`s on one machine never collide; the daemon is told the routers' URLs.",
        parse=int)
    fleet_policy: str = variable(
        "BATCH_FLEET_POLICY", "cache_aware", "Engine",
        "The router's load-balancing policy (vllm-router --policy).", parse=_policy)
    fleet_idle_s: float = variable(
        "BATCH_FLEET_IDLE_S", 1800, "Engine",
        "`make serve`: seconds a fleet whose model has no batch stays warm; then its replicas stop, giving their "
        "memory back (the router stays), and start again on the model's next batch, whose ETA counts the start. 0: "
        "warm for ever.", parse=float)
    fleet_urls: dict[str, str] = variable(
        "BATCH_FLEET_URLS", "", "Engine",
        "Comma-separated `model=url` entries: the router (or server) of a running fleet for each model; its batches "
        "run in server mode there. `make serve` sets it for its daemon from the fleets it starts; on Kubernetes, each "
        "model's router Service.", parse=parse_fleet_urls)
    offline_runs: int = variable(
        "BATCH_OFFLINE_RUNS", DEFAULT_OFFLINE_RUNS, "Engine",
        "Runs holding an in-process engine (a model with no fleet or server) at once; more wait in Dagster's run "
        "queue. Each such engine takes the GPUs its process sees (on one machine, all of them), so raise it only "
        "where each run has GPUs of its own (a pod per run or step on Kubernetes). `batch-dagster instance` writes it "
        "into $DAGSTER_HOME/dagster.yaml.", parse=int)
    runs_per_model: int = variable(
        "BATCH_RUNS_PER_MODEL", DEFAULT_RUNS_PER_MODEL, "Engine",
        "Runs of one model at once (batches sharing its fleet); more wait in the run queue. Written into dagster.yaml,"
        " as BATCH_OFFLINE_RUNS.", parse=int)
    executor: str = variable(
        "BATCH_EXECUTOR", "in_process", "Engine",
        "How batch_job runs its steps: `in_process` (one after the other in the run's process), `multiprocess` (a "
        "process per step) or `k8s` (dagster-k8s' k8s_job_executor: a pod per step, the inference step's pod asking "
        "for a GPU by its tags).",)
    step_retry_delay_s: float = variable(
        "BATCH_STEP_RETRY_DELAY_S", 2.0, "Engine",
        "Seconds before the inference step's first retry after an engine crash (doubling for the next); read when the "
        "definitions load.", parse=float)
    shard_size: int = variable(
        "BATCH_SHARD_SIZE", 1000, "Limits",
        "Requests per shard: the unit of commit, resume and progress.", parse=int)
    max_requests: int = variable(
        "BATCH_MAX_REQUESTS", Limits.max_requests, "Limits",
        "Requests per input file.", parse=int)
    max_bytes: int = variable(
        "BATCH_MAX_BYTES", Limits.max_bytes, "Limits",
        "Bytes per input file.", parse=int)
    max_line_bytes: int = variable(
        "BATCH_MAX_LINE_BYTES", Limits.max_line_bytes, "Limits",
        "Bytes per input line.", parse=int)
    max_enqueued_tokens: int | None = variable(
        "BATCH_MAX_ENQUEUED_TOKENS", None, "Limits",
        "Prompt tokens one owner may have enqueued per model (this batch plus the owner's unfinished ones); past it a "
        "batch fails with `token_limit_exceeded`. Unset: no limit.", parse=_limit)
    image_hosts: tuple[str, ...] = variable(
        "BATCH_IMAGE_HOSTS", (), "Limits",
        "Comma-separated hosts whose http(s) image URLs a request may name, on a model whose registry entry takes "
        "images (`images_per_request`); each image is fetched once per batch, with the webhooks' address checks "
        "(public addresses, or BATCH_WEBHOOK_ALLOW). Unset: data URLs only.", parse=_csv)
    max_image_bytes: int = variable(
        "BATCH_MAX_IMAGE_BYTES", DEFAULT_MAX_IMAGE_BYTES, "Limits",
        "Bytes of one image a request sends (a data URL's data) or names (a fetched one).", parse=int)
    image_budget_bytes: int = variable(
        "BATCH_IMAGE_BUDGET_BYTES", 1 << 30, "Limits",
        "Bytes one batch may fetch of the images its requests name, in all (as they arrive, decompressed); past it "
        "a request naming an image not fetched yet is its own 400 line. The images are kept in the batch's folder "
        "and count against its key's BATCH_KEY_MAX_STORED_BYTES from when they are fetched.", parse=int)
    image_budget_s: float = variable(
        "BATCH_IMAGE_BUDGET_S", 600.0, "Limits",
        "Seconds one batch may spend fetching the images its requests name, in all; past it a request naming an image "
        "not fetched yet is its own 400 line. Each fetch also ends 30 s after it starts, however its bytes trickle "
        "in.", parse=float)
    error_breaker_lines: int = variable(
        "BATCH_ERROR_BREAKER_LINES", 200, "Limits",
        "The error-rate breaker's sample: once at least this many of a batch's lines have ended (it checks before each "
        "shard), a batch whose failed share is past the rate stops, `failed` with `error_rate_exceeded`, keeping what "
        "it finished. Only the requests' own failures count: `engine_error` and `out_of_memory` lines (the service's) "
        "are left out. 0: no breaker.", parse=int)
    error_breaker_rate: float | None = variable(
        "BATCH_ERROR_BREAKER_RATE", 0.95, "Limits",
        "The share (0 to 1) of failed lines among a batch's first BATCH_ERROR_BREAKER_LINES at which it stops; a "
        "batch's own `error_breaker_rate` (create body) replaces it. 0: no breaker.", parse=_rate)
    estimate_tokens_per_s: float = variable(
        "BATCH_ESTIMATE_TOKENS_PER_S", 250.0, "Limits",
        "Tokens (prompt and output) per second an estimate's duration assumes for a model with no completed batch yet;"
        " once it has some, their measured rate is used. The default is about what one CPU replica of SmolLM2-135M "
        "generates (a low rate once prompt tokens count too).", parse=float)
    reuse_answers: bool = variable(
        "BATCH_REUSE_ANSWERS", False, "Limits",
        "Whether a batch that does not say (its `reuse` option) takes the answers of deterministic requests "
        "(temperature 0, a seed, embeddings) asked before of the same model from the answer store, billed at zero, and "
        "keeps its own there. Table batches reuse unless told not to.", parse=_switch)
    answer_store_bytes: int = variable(
        "BATCH_ANSWER_STORE_BYTES", DEFAULT_ANSWER_STORE_BYTES, "Limits",
        "The answer store's bound, in bytes (answers/ where the batch folders live): past it the answers written "
        "first are deleted first.", parse=int)
    shared_owners: tuple[str, ...] = variable(
        "BATCH_SHARED_OWNERS", (), "Limits",
        "Comma-separated owners whose batches share kept answers (the answer store) and prompt prefixes (vLLM's "
        "prefix cache) with each other: API keys by name (as `batch-dagster keys list` shows them), table batches by "
        "namespace; `*`: every owner. Unset: nothing is shared, each owner's answers and cached prefixes are its "
        "own.", parse=_csv)
    max_upload_bytes: int = variable(
        "BATCH_MAX_UPLOAD_BYTES", "$BATCH_MAX_BYTES", "API",
        "Largest upload the API accepts (413 past it).", parse=int)
    max_json_body_bytes: int = variable(
        "BATCH_MAX_JSON_BODY_BYTES", 1 << 20, "API",
        "Largest JSON request body the API reads (413 past it).", parse=int)
    estimate_timeout_s: float = variable(
        "BATCH_ESTIMATE_TIMEOUT_S", 120.0, "API",
        "How long POST /v1/batches/estimate may count one file's tokens (and `batch-dagster estimate`), from its first "
        "request on: past it the count is stopped and the estimate answers `count_timeout` with the line it reached "
        "(split the file, or create the batch: validation counts it with no such bound). Each request also has vLLM's "
        "own bound on rendering it.", parse=float)
    completion_windows: tuple[str, ...] = variable(
        "BATCH_COMPLETION_WINDOWS", ("1h", "24h"), "API",
        "The `completion_window` values a batch may ask, comma-separated: a whole number of hours and `h`. Its batch "
        "expires that long after it is created; `24h=600` makes the 24h window 600 s long (tests, benches). A dropped "
        "file's batch takes the longest; each window's price is in BATCH_PRICES_FILE (`[windows.NAME]`).",
        parse=_windows)
    # Its entries are `name:key` or `key` (split_key).
    api_keys: tuple[str, ...] = variable(
        "BATCH_API_KEYS", (), "API",
        "Comma-separated API keys, each `name:key` or a bare `key`; the name is the owner the Dagster UI shows (a bare"
        " key shows as `key-` and a keyed hash). Seeded into the store when the API starts: a key it never saw is "
        "added, one the variable made that left it is revoked, and none revoked or rotated in the store comes back. "
        "Unset: nothing seeded; with no key in the store either, no authentication, loopback only.",
        parse=api_key_entries, secret=True)
    sensor_loop_s: float = variable(
        "BATCH_SENSOR_LOOP_S", 0.5, "API",
        "Seconds between the Dagster daemon's looks for due sensors under serve (Dagster's own loop is 5 s; 0.1 at "
        "least). A sensor is evaluated at the first look once its minimum interval (1 s for the API's two) has passed: "
        "under a 1 s loop a tick that began just after the look was not due at the next one, and they ran every 1.7 s "
        "(median; 1 to 2.6 s), so an API batch waited that long for its launch. Idle, the 1 s loop and the API "
        "sensors' 1 s ticks cost about a tenth of a CPU core more than 5 s (2-core Xeon, 2026-12-03).",
        parse=_loop_seconds)
    key_max_priority: int = variable(
        "BATCH_KEY_MAX_PRIORITY", 0, "API",
        "The highest `priority` (-10..10) a key's batch may ask at create; above it the create answers 400 "
        "`priority_not_allowed`. 0 (the default): keys may only lower theirs, so no key puts its backlog ahead of "
        "everyone's; raise it for the keys that may (`batch-dagster keys limits NAME --max-priority N`).", parse=int)
    key_daily_budget: float | None = variable(
        "BATCH_KEY_DAILY_BUDGET", None, "API",
        "What one key's batches created on a UTC day may cost in all, in the price table's currency (successful "
        "requests, at the batch price; a batch's whole spend counts against the day it was created on, even what it "
        "spends after midnight). A batch whose upper-bound cost is past what is left fails validation with "
        "`cost_limit_exceeded`; a running one stops there before its next shard. Unset or 0: no budget.",
        parse=_budget)
    key_max_active_batches: int | None = variable(
        "BATCH_KEY_MAX_ACTIVE_BATCHES", 100, "API",
        "Batches one key may have unfinished at once (created, not ended); past it creating a batch answers 429 "
        "`batch_limit_exceeded`. 0: no limit.", parse=_limit)
    key_max_stored_bytes: int | None = variable(
        "BATCH_KEY_MAX_STORED_BYTES", 100 << 30, "API",
        "Bytes of files one key may keep stored (its uploads and its batches' output and error files, until deleted or"
        " expired); past it an upload answers 429 `storage_limit_exceeded`: from its declared length before its body "
        "is read, or once its file's bytes pass the key's room as they stream in. 0: no limit.", parse=_limit)
    key_max_uploads: int | None = variable(
        "BATCH_KEY_MAX_UPLOADS", 4, "API",
        "Uploads one key may have streaming into one API process at once; past it an upload answers 429 "
        "`too_many_uploads` before its body is read. 0: no limit.", parse=_limit)
    idempotency_ttl_s: int = variable(
        "BATCH_IDEMPOTENCY_TTL_S", DAY_S, "API",
        "Seconds an `Idempotency-Key` of a create (POST /v1/files, /v1/batches) is kept from its first use: a repeat "
        "within them answers the object the first made; after them the key is free again and the retention sensor "
        "deletes it.", parse=int)
    key_max_interactive_calls: int | None = variable(
        "BATCH_KEY_MAX_INTERACTIVE_CALLS", 8, "API",
        "Interactive calls (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, forwarded to a "
        "model's warm fleet) one key may have in flight in one API process at once, streams included until they end;"
        " past it a call answers 429 `too_many_interactive_calls` with `Retry-After`. 0: no limit.", parse=_limit)
    api_host: str = variable(
        "BATCH_API_HOST", LOOPBACK, "API",
        "The address `make serve` binds the API to.",)
    api_port: int = variable(
        "BATCH_API_PORT", 8000, "API",
        "The API's port under `make serve`.", parse=int)
    metrics_host: str = variable(
        "BATCH_METRICS_HOST", LOOPBACK, "API",
        "The address of the API's Prometheus metrics: /metrics on a listener of its own, never the API's (they name "
        "every key and what it runs, so they are the operator's). On Kubernetes `0.0.0.0`, the pod's address, for "
        "Prometheus to scrape inside the cluster; keep the port off the Service and the ingress.",)
    metrics_port: int = variable(
        "BATCH_METRICS_PORT", 0, "API",
        "The metrics listener's port (deploy/k8s: 9464); 0: a free port chosen at start, logged, and written by "
        "`make serve` into its Prometheus targets.", parse=int)
    webhook_urls: tuple[str, ...] = variable(
        "BATCH_WEBHOOK_URLS", (), "API",
        "Comma-separated endpoints that get a signed POST when a batch ends (batch.completed, batch.failed, "
        "batch.expired, batch.cancelled); unset: no webhooks.", parse=_csv)
    webhook_secret: str = variable(
        "BATCH_WEBHOOK_SECRET", "", "API",
        "The Standard Webhooks secret (`whsec_` and base64) webhooks are signed with; needed with BATCH_WEBHOOK_URLS.",
        secret=True)
    s3_bucket: str = variable(
        "BATCH_S3_BUCKET", "", "Drop folders",
        "The bucket the S3 drop sensor watches; unset: the sensor is off.",)
    s3_prefix: str = variable(
        "BATCH_S3_PREFIX", "incoming/", "Drop folders",
        "Where in the bucket new .jsonl files are picked up.",)
    s3_output_prefix: str = variable(
        "BATCH_S3_OUTPUT_PREFIX", "results/", "Drop folders",
        "Where results go: <prefix><batch_id>/ in the same bucket.",)
    inbox_dir: Path = variable(
        "BATCH_INBOX_DIR", "$BATCH_DATA_DIR/inbox", "Drop folders",
        "The local inbox folder the inbox sensor watches.", parse=Path)
    outbox_dir: Path = variable(
        "BATCH_OUTBOX_DIR", "the inbox's sibling outbox/", "Drop folders",
        "Where the inbox's results go: <outbox>/<batch_id>/.",
        parse=Path, derive=lambda v: v["BATCH_INBOX_DIR"].parent / "outbox")
    intake_api_key: str = variable(
        "BATCH_INTAKE_API_KEY", "", "Drop folders",
        "The key (one of BATCH_API_KEYS) whose owner dropped files' batches belong to: listed under it in the API, its"
        " webhooks told. Unset while BATCH_API_KEYS is set: the drop sensors take no file (each tick skips, saying "
        "so), since no key was chosen to own them. Unset with no keys: the keyless loopback owner.", secret=True)
    webhook_allow: tuple[str, ...] = variable(
        "BATCH_WEBHOOK_ALLOW", (), "API",
        "Comma-separated hosts or CIDRs that keys' own webhook endpoints may reach although not public (loopback, "
        "private, link-local); unset: public addresses only. BATCH_WEBHOOK_URLS are the operator's and always trusted.",
        parse=_allow)
    # Retention: how long a batch's working history is kept, and where the daily report starts.
    history_retention_s: int = variable(
        "BATCH_HISTORY_RETENTION_S", 30 * DAY_S, "Retention",
        "Seconds after a batch ends at which its Dagster history (partition, runs, event logs, step logs) and its "
        "folder's working files are deleted; the batch's row, its summary.json and the files it still has stay. 0: "
        "kept for ever.", parse=int)
    history_max_batches: int = variable(
        "BATCH_HISTORY_MAX_BATCHES", 5000, "Retention",
        "The most batch partitions the Dagster UI has to draw: past it the batches that ended first have their "
        "Dagster history deleted as BATCH_HISTORY_RETENTION_S would, however recent (their rows, summary.json and the "
        "files still served stay). Every UI page rendered within 3 s at 5,000 here (make bench-scale); 0: no bound.",
        parse=int)
    scratch_max_age_s: int = variable(
        "BATCH_SCRATCH_MAX_AGE_S", DAY_S, "Retention",
        "Age past which a scratch file (of a process killed while it held it) or a staged step log of a finished run "
        "is swept by the retention sensor.", parse=int)
    # None: the store's first batch decides (defs/partitions.py), when the definitions load.
    report_start: date | None = variable(
        "BATCH_REPORT_START", "the day of the store's first batch", "Retention",
        "The first day (YYYY-MM-DD) of the daily report's partitions; unset: the UTC day of the store's first batch, "
        "read when the definitions load (today while there is none).", parse=_day, derive=lambda v: None)

    @property
    def limits(self) -> Limits:
        return Limits.of(self)

    @property
    def image_sources(self) -> ImageSources:
        return ImageSources.of(self.image_hosts, self.max_image_bytes)

    @property
    def windows(self) -> CompletionWindows:
        return CompletionWindows.of(self.completion_windows)

    @property
    def scratch_dir(self) -> Path:
        """This process's local scratch: files lent by, or staged for, a remote store."""
        return storage_location(self.data_dir, self.storage_url)[1]

    def storage(self) -> Storage:
        """Where batch folders and files live (BATCH_STORAGE_URL)."""
        return open_batch_storage(self.data_dir, self.storage_url)

    def served_fleet_models(self) -> tuple[list[str], list[str]]:
        """The models `make serve` keeps a warm fleet of: BATCH_FLEET_MODELS, else the registry's first chat model;
        and the names BATCH_FLEET_MODELS lists that the registry does not have (they get no fleet)."""
        from batch_dagster.batchfile.registry import default_chat_model, load_registry

        registry = load_registry(self.models_file)
        if not self.fleet_models:
            first = default_chat_model(registry)
            return ([first] if first else []), []
        listed = list(dict.fromkeys(self.fleet_models))
        return [m for m in listed if m in registry], [m for m in listed if m not in registry]

    @classmethod
    def from_env(cls) -> Settings:
        values: dict[str, Any] = {}
        for variable in VARIABLES:  # in order: a default may name the variables before it
            values[variable.name] = variable.read(values)
        return cls(**{_BY_NAME[name].field: value for name, value in values.items()})


VARIABLES: tuple[Variable, ...] = tuple(replace(f.metadata[_DECLARED], field=f.name) for f in fields(Settings))
_BY_NAME = {v.name: v for v in VARIABLES}


def markdown() -> str:
    """The configuration tables of docs/configuration.md, one per section."""
    out: list[str] = []
    for section in dict.fromkeys(v.section for v in VARIABLES):
        out += [f"### {section}", "", "| variable | default | meaning |", "|---|---|---|"]
        for v in VARIABLES:
            if v.section == section:
                text = v.text()
                default = text if text.startswith("the ") else f"`{text}`" if text else "(unset)"
                out.append(f"| `{v.name}` | {default} | {v.meaning} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


BEGIN, END = "<!-- BEGIN GENERATED: settings -->", "<!-- END GENERATED: settings -->"


def with_tables(doc: str) -> str:
    """`doc` with the text between its BEGIN and END markers replaced by `markdown()`."""
    return generated.between(doc, BEGIN, END, markdown())


if __name__ == "__main__":
    generated.main(markdown, with_tables,
                   "python -m batch_dagster.settings --markdown | --update docs/configuration.md")
