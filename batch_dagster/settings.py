"""The one configuration: every BATCH_* variable, its default and its meaning, and the only reader of them.

`VARIABLES` is the list the docs' configuration tables are generated from
(`python -m batch_dagster.settings --markdown`); a test checks that every variable the code names is
in it. Defaults work on a laptop.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from batch_dagster.batchfile.contract import Limits
from batch_dagster.batchfile.storage import Storage

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "config"
DAY_S = 24 * 3600
DEFAULT_OFFLINE_RUNS = 1
DEFAULT_RUNS_PER_MODEL = 4


@dataclass(frozen=True)
class Variable:
    """One environment variable: its default as text ("" for none) and what it means."""

    name: str
    default: str
    meaning: str
    section: str


_L = Limits()
VARIABLES: tuple[Variable, ...] = (
    Variable("BATCH_DATA_DIR", "./data", "This process's local folder: batch folders, uploaded files and reports "
             "(unless BATCH_STORAGE_URL points elsewhere), scratch, logs and (by default) the SQLite store and the "
             "models.", "Storage"),
    Variable("BATCH_STORAGE_URL", "$BATCH_DATA_DIR", "Where batch folders, uploaded files and reports live: a local "
             "path, or "
             "s3://bucket/prefix on any S3-compatible store (boto3's own AWS_ENDPOINT_URL, AWS_* configure it). "
             "Every process of a deployment must name the same place.", "Storage"),
    Variable("BATCH_MODEL_CACHE", "$BATCH_DATA_DIR/models", "Where embedded models are prepared.", "Storage"),
    Variable("BATCH_DATABASE_URL", "sqlite:///$BATCH_DATA_DIR/batch-api.db",
             "The API's metadata store: any SQLAlchemy URL (e.g. postgresql+psycopg://...).", "Storage"),
    Variable("BATCH_MODELS_FILE", "batch_dagster/config/models.toml", "The model registry.", "Models"),
    Variable("BATCH_PRICES_FILE", "batch_dagster/config/prices.toml", "The price table (per million tokens, "
             "batch discount).", "Models"),
    Variable("BATCH_ENGINE_MODE", "offline", "`offline`: vLLM in the run's process; `server`: OpenAI-compatible "
             "vLLM servers at BATCH_VLLM_SERVER_URLS.", "Engine"),
    Variable("BATCH_VLLM_SERVER_URLS", "", "Comma-separated base URLs of vLLM servers (server mode).", "Engine"),
    Variable("BATCH_VLLM_API_KEY", "", "The key the vLLM servers expect, if any.", "Engine"),
    Variable("BATCH_VLLM_MAX_CONCURRENCY", "64", "Requests in flight to the servers at once (server mode).",
             "Engine"),
    Variable("BATCH_FLEET_REPLICAS", "1", "`make serve`: vLLM servers of the warm fleet (pinned one per core) behind "
             "vllm-router; 0: no fleet, every batch runs offline in its run.", "Engine"),
    Variable("BATCH_FLEET_MODEL", "the registry's first chat model", "`make serve`: the model the fleet serves; "
             "batches of other models run offline.", "Engine"),
    Variable("BATCH_FLEET_PORT", "8200", "`make serve`: the fleet router's port; replicas take the next ports.",
             "Engine"),
    Variable("BATCH_FLEET_POLICY", "cache_aware", "The router's load-balancing policy (vllm-router --policy).",
             "Engine"),
    Variable("BATCH_FLEET_URL", "", "The router (or server) of a running fleet for BATCH_FLEET_MODEL: its batches "
             "run in server mode there. `make serve` sets it for its daemon when it starts a fleet.", "Engine"),
    Variable("BATCH_OFFLINE_RUNS", str(DEFAULT_OFFLINE_RUNS), "Runs holding an in-process engine (a model "
             "with no fleet or server) at once; more wait in Dagster's run queue. One per GPU. `batch-dagster "
             "instance` writes it into $DAGSTER_HOME/dagster.yaml.", "Engine"),
    Variable("BATCH_RUNS_PER_MODEL", str(DEFAULT_RUNS_PER_MODEL), "Runs of one model at once (batches "
             "sharing its fleet); more wait in the run queue. Written into dagster.yaml, as BATCH_OFFLINE_RUNS.",
             "Engine"),
    Variable("BATCH_EXECUTOR", "in_process", "How batch_job runs its steps: `in_process` (one after the other in the "
             "run's process), `multiprocess` (a process per step) or `k8s` (dagster-k8s' k8s_job_executor: a pod per "
             "step, the inference step's pod asking for a GPU by its tags).", "Engine"),
    Variable("BATCH_SHARD_SIZE", "1000", "Requests per shard: the unit of commit, resume and progress.",
             "Limits"),
    Variable("BATCH_MAX_REQUESTS", str(_L.max_requests), "Requests per input file.", "Limits"),
    Variable("BATCH_MAX_BYTES", str(_L.max_bytes), "Bytes per input file.", "Limits"),
    Variable("BATCH_MAX_LINE_BYTES", str(_L.max_line_bytes), "Bytes per input line.", "Limits"),
    Variable("BATCH_MAX_ENQUEUED_TOKENS", "", "Prompt tokens one owner may have enqueued per model (this batch "
             "plus the owner's unfinished ones); past it a batch fails with `token_limit_exceeded`. Unset: no "
             "limit.", "Limits"),
    Variable("BATCH_MAX_UPLOAD_BYTES", "$BATCH_MAX_BYTES", "Largest upload the API accepts (413 past it).", "API"),
    Variable("BATCH_MAX_JSON_BODY_BYTES", str(1 << 20), "Largest JSON request body the API reads (413 past it).",
             "API"),
    Variable("BATCH_COMPLETION_WINDOW_S", str(DAY_S), "Seconds after creation at which a batch expires "
             "(API and drop-folder batches).", "API"),
    Variable("BATCH_API_KEYS", "", "Comma-separated API keys; unset: no authentication, loopback only.", "API"),
    Variable("BATCH_API_HOST", "127.0.0.1", "The address `make serve` binds the API to.", "API"),
    Variable("BATCH_API_PORT", "8000", "The API's port under `make serve`.", "API"),
    Variable("BATCH_WEBHOOK_URLS", "", "Comma-separated endpoints that get a signed POST when a batch ends "
             "(batch.completed, batch.failed, batch.expired, batch.cancelled); unset: no webhooks.", "API"),
    Variable("BATCH_WEBHOOK_SECRET", "", "The Standard Webhooks secret (`whsec_` and base64) webhooks are signed "
             "with; needed with BATCH_WEBHOOK_URLS.", "API"),
    Variable("BATCH_S3_BUCKET", "", "The bucket the S3 drop sensor watches; unset: the sensor is off.",
             "Drop folders"),
    Variable("BATCH_S3_PREFIX", "incoming/", "Where in the bucket new .jsonl files are picked up.", "Drop folders"),
    Variable("BATCH_S3_OUTPUT_PREFIX", "results/", "Where results go: <prefix><batch_id>/ in the same bucket.",
             "Drop folders"),
    Variable("BATCH_INBOX_DIR", "$BATCH_DATA_DIR/inbox", "The local inbox folder the inbox sensor watches.",
             "Drop folders"),
    Variable("BATCH_OUTBOX_DIR", "the inbox's sibling outbox/", "Where the inbox's results go: "
             "<outbox>/<batch_id>/.", "Drop folders"),
    Variable("BATCH_INTAKE_API_KEY", "the first of BATCH_API_KEYS", "The key whose owner dropped files' batches "
             "are listed under in the API.", "Drop folders"),
    Variable("BATCH_WEBHOOK_ALLOW", "", "Comma-separated hosts or CIDRs that keys' own webhook endpoints may reach "
             "although not public (loopback, private, link-local); unset: public addresses only. BATCH_WEBHOOK_URLS "
             "are the operator's and always trusted.", "API"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def is_set(name: str) -> bool:
    """Whether the variable has a non-empty value in the environment."""
    return bool(_raw(name))


def _raw(name: str) -> str:
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a documented variable (add it to settings.VARIABLES)")
    return os.environ.get(name, "").strip()


def _int(name: str, default: int) -> int:
    value = _raw(name)
    return int(value) if value else default


def _list(name: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in _raw(name).split(",") if part.strip())


@dataclass(frozen=True)
class Settings:
    """Every setting, typed, as the environment gives it now."""

    data_dir: Path
    storage_url: str
    model_cache_dir: Path
    database_url: str
    models_file: Path
    prices_file: Path
    engine_mode: str
    vllm_server_urls: tuple[str, ...]
    vllm_api_key: str | None
    vllm_max_concurrency: int
    fleet_replicas: int
    fleet_model: str
    fleet_port: int
    fleet_policy: str
    fleet_url: str
    offline_runs: int
    executor: str
    runs_per_model: int
    shard_size: int
    limits: Limits
    max_enqueued_tokens: int | None
    max_upload_bytes: int
    max_json_body_bytes: int
    completion_window_s: int
    api_keys: tuple[str, ...]
    api_host: str
    api_port: int
    webhook_urls: tuple[str, ...]
    webhook_secret: str
    s3_bucket: str
    s3_prefix: str
    s3_output_prefix: str
    inbox_dir: Path
    outbox_dir: Path
    intake_api_key: str
    webhook_allow: tuple[str, ...]  # hosts or CIDRs keys' own webhook endpoints may reach although internal

    @property
    def scratch_dir(self) -> Path:
        """This process's local scratch: files lent by, or staged for, a remote store."""
        return self.data_dir / "scratch"

    def storage(self) -> Storage:
        """Where batch folders and files live (BATCH_STORAGE_URL)."""
        from batch_dagster.storage import open_storage

        return open_storage(self.storage_url, self.scratch_dir)

    @classmethod
    def from_env(cls) -> Settings:
        data_dir = Path(_raw("BATCH_DATA_DIR") or Path.cwd() / "data").resolve()
        limits = Limits(
            max_requests=_int("BATCH_MAX_REQUESTS", _L.max_requests),
            max_bytes=_int("BATCH_MAX_BYTES", _L.max_bytes),
            max_line_bytes=_int("BATCH_MAX_LINE_BYTES", _L.max_line_bytes),
        )
        inbox = Path(_raw("BATCH_INBOX_DIR") or data_dir / "inbox")
        keys = _list("BATCH_API_KEYS")
        return cls(
            data_dir=data_dir,
            storage_url=_raw("BATCH_STORAGE_URL") or str(data_dir),
            model_cache_dir=Path(_raw("BATCH_MODEL_CACHE") or data_dir / "models"),
            database_url=_raw("BATCH_DATABASE_URL") or f"sqlite:///{data_dir / 'batch-api.db'}",
            models_file=Path(_raw("BATCH_MODELS_FILE") or CONFIG_DIR / "models.toml"),
            prices_file=Path(_raw("BATCH_PRICES_FILE") or CONFIG_DIR / "prices.toml"),
            engine_mode=_raw("BATCH_ENGINE_MODE") or "offline",
            vllm_server_urls=_list("BATCH_VLLM_SERVER_URLS"),
            vllm_api_key=_raw("BATCH_VLLM_API_KEY") or None,
            vllm_max_concurrency=_int("BATCH_VLLM_MAX_CONCURRENCY", 64),
            fleet_replicas=_int("BATCH_FLEET_REPLICAS", 1),
            fleet_model=_raw("BATCH_FLEET_MODEL"),  # empty: the registry's first chat model
            fleet_port=_int("BATCH_FLEET_PORT", 8200),
            fleet_policy=_raw("BATCH_FLEET_POLICY") or "cache_aware",
            fleet_url=_raw("BATCH_FLEET_URL"),
            offline_runs=_int("BATCH_OFFLINE_RUNS", DEFAULT_OFFLINE_RUNS),
            executor=_raw("BATCH_EXECUTOR") or "in_process",
            runs_per_model=_int("BATCH_RUNS_PER_MODEL", DEFAULT_RUNS_PER_MODEL),
            shard_size=_int("BATCH_SHARD_SIZE", 1000),
            limits=limits,
            max_enqueued_tokens=_int("BATCH_MAX_ENQUEUED_TOKENS", 0) or None,
            max_upload_bytes=_int("BATCH_MAX_UPLOAD_BYTES", limits.max_bytes),
            max_json_body_bytes=_int("BATCH_MAX_JSON_BODY_BYTES", 1 << 20),
            completion_window_s=_int("BATCH_COMPLETION_WINDOW_S", DAY_S),
            api_keys=keys,
            api_host=_raw("BATCH_API_HOST") or "127.0.0.1",
            api_port=_int("BATCH_API_PORT", 8000),
            webhook_urls=_list("BATCH_WEBHOOK_URLS"),
            webhook_secret=_raw("BATCH_WEBHOOK_SECRET"),
            s3_bucket=_raw("BATCH_S3_BUCKET"),
            s3_prefix=_raw("BATCH_S3_PREFIX") or "incoming/",
            s3_output_prefix=_raw("BATCH_S3_OUTPUT_PREFIX") or "results/",
            inbox_dir=inbox,
            outbox_dir=Path(_raw("BATCH_OUTBOX_DIR") or inbox.parent / "outbox"),
            intake_api_key=_raw("BATCH_INTAKE_API_KEY") or (keys[0] if keys else ""),
            webhook_allow=_list("BATCH_WEBHOOK_ALLOW"),
        )


def markdown() -> str:
    """The configuration tables of docs/configuration.md, one per section."""
    out: list[str] = []
    for section in dict.fromkeys(v.section for v in VARIABLES):
        out += [f"### {section}", "", "| variable | default | meaning |", "|---|---|---|"]
        for v in VARIABLES:
            if v.section == section:
                default = v.default if v.default.startswith("the ") else f"`{v.default}`" if v.default else "(unset)"
                out.append(f"| `{v.name}` | {default} | {v.meaning} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


BEGIN, END = "<!-- BEGIN GENERATED: settings -->", "<!-- END GENERATED: settings -->"


def with_tables(doc: str) -> str:
    """`doc` with the text between its BEGIN and END markers replaced by `markdown()`."""
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{markdown()}{END}{tail}"


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
    elif len(args) == 2 and args[0] == "--update":
        doc = Path(args[1])
        doc.write_text(with_tables(doc.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.exit("usage: python -m batch_dagster.settings --markdown | --update docs/configuration.md")
