"""The registry's models as the engine runs them: their specs, their local weights folders, their tokenizers.

The Dagster resource (defs/resources/vllm.py), the CLI's server commands and `serve`'s fleet all look a
model up here, so none of them needs the others to find a model.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson

from batch_dagster.batchfile.registry import ModelSpec, default_chat_model, load_registry

from . import tokens
from .hardware import DtypeChoice, dtype_choice
from .prepare import embedded_name, resolve_embedded
from .tokens import CountTokens


class UnknownModel(KeyError):
    """A model name that is not in the registry."""

    def __str__(self) -> str:
        return str(self.args[0])


@functools.cache
def _registry(models_file: str) -> dict[str, ModelSpec]:
    return load_registry(Path(models_file))


# The tokenizer class AutoTokenizer chose for each local model folder, as `{folder: [class name, signature]}`, kept
# in the model cache: a later process loads that class directly. AutoTokenizer's own module imports torch (about
# 3 s in a fresh process, most of a small batch's validation); the tokenizer classes do not (under 1 s).
TOKENIZER_CLASSES = "tokenizer-classes.json"


def _signature(folder: Path) -> str | None:
    """What AutoTokenizer's choice for a local folder rests on (its tokenizer and model configs), as their sizes and
    change times; None for a hub id or a folder without a tokenizer config."""
    parts = []
    for name in ("tokenizer_config.json", "config.json"):
        try:
            stat = (folder / name).stat()
        except OSError:
            if name == "tokenizer_config.json":
                return None
            continue
        parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    return ";".join(parts)


def _known_classes(record: Path) -> dict[str, Any]:
    try:
        known = orjson.loads(record.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return known if isinstance(known, dict) else {}


@functools.cache
def _tokenizer(model_path: str, cache_dir: str) -> Any:
    """The model's tokenizer as AutoTokenizer loads it: through the class it chose for this folder before, when the
    folder is unchanged since; else through AutoTokenizer, whose choice is then kept for the next process."""
    import transformers

    record, signature = Path(cache_dir) / TOKENIZER_CLASSES, _signature(Path(model_path))
    known = _known_classes(record) if signature else {}
    entry = known.get(model_path)
    name, seen = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
    cls = getattr(transformers, name, None) if isinstance(name, str) and seen == signature else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cast(Any, cls).from_pretrained(model_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    name = type(tokenizer).__name__
    if signature and getattr(transformers, name, None) is type(tokenizer):  # not a model's own (remote) code
        known = {**_known_classes(record), model_path: [name, signature]}
        with contextlib.suppress(OSError):  # a read-only cache: the next process asks AutoTokenizer again
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f"{record.name}.tmp-{os.getpid()}")
            tmp.write_bytes(orjson.dumps(known, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
            os.replace(tmp, record)
    return tokenizer


@dataclass(frozen=True)
class Models:
    """The models of the registry `models_file`; embedded ones are prepared under `model_cache_dir`."""

    models_file: str
    model_cache_dir: str

    @classmethod
    def from_settings(cls, settings: Any) -> Models:
        return cls(str(settings.models_file), str(settings.model_cache_dir))

    def registry(self) -> dict[str, ModelSpec]:
        return _registry(self.models_file)

    def default_chat_model(self) -> str | None:
        return default_chat_model(self.registry())

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.registry()[model]
        except KeyError:
            raise UnknownModel(f"Model {model!r} is not in the registry {self.models_file}.") from None

    def dtype(self, spec: ModelSpec) -> DtypeChoice:
        """The dtype the model runs in on this host (the registry's "auto" resolved) and why."""
        return dtype_choice(spec.dtype)

    def path(self, spec: ModelSpec) -> str:
        """A local folder or hub id for the engine; embedded models are prepared on first use, in their dtype."""
        name = embedded_name(spec)
        if name is not None:
            return str(resolve_embedded(name, Path(self.model_cache_dir), self.dtype(spec).dtype))
        return spec.source

    def tokenizer(self, model: str) -> Any:
        """The model's tokenizer (transformers), for counting an embedding model's inputs before anything runs."""
        return _tokenizer(self.path(self.spec(model)), self.model_cache_dir)

    def counter(self, model: str, *, servers: list[str] | None = None, api_key: str | None = None,
                budget_s: float | None = None) -> tuple[CountTokens, int]:
        """How `model`'s prompt tokens are counted before anything runs, and the model's context length.

        A generation model's bodies are rendered by vLLM (engine/counting.py): by its `servers` (a fleet's router, or
        server mode's servers) when given, else by this process's count worker. Each body has vLLM's own bound on
        rendering, and all of them `budget_s` from the first (tokens.bounded).
        """
        from . import counting

        spec = self.spec(model)
        if spec.task == "embed":
            tokenizer = self.tokenizer(model)
            return (tokens.bounded(tokens.pooling_counter(tokenizer), budget_s),
                    spec.max_model_len or tokens.stated_context_length(tokenizer, self.path(spec)))
        worker = counting.shared_worker(self.models_file, self.model_cache_dir)
        local = counting.worker_count(worker, model)
        if servers:
            remote = counting.ServerCount(servers, model, api_key)
            context = spec.max_model_len or remote.context_length() or worker.context_length(model)
            return tokens.bounded(counting.servers_then_worker(remote, local), budget_s), context
        return tokens.bounded(local, budget_s), worker.context_length(model)


def server_urls_for(model: str, fleet_urls: dict[str, str], mode: str, server_urls: list[str]) -> list[str] | None:
    """Where a model's requests go in server mode (its fleet first), or None when it runs offline, in the process."""
    if model in fleet_urls:
        return [fleet_urls[model]]
    return list(server_urls) if mode == "server" else None
