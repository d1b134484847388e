"""The registry's models as the engine runs them: their specs, their local weights folders, their tokenizers.

The Dagster resource (defs/resources/vllm.py), the CLI's server commands and `serve`'s fleet all look a
model up here, so none of them needs the others to find a model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@functools.cache
def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


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
        """The model's tokenizer (transformers), for counting prompt tokens before anything runs."""
        return _tokenizer(self.path(self.spec(model)))

    def counter(self, model: str) -> tuple[CountTokens, int]:
        """How an estimate counts `model`'s prompt tokens, and the model's context length."""
        spec, tokenizer = self.spec(model), self.tokenizer(model)
        return tokens.counter(tokenizer), spec.max_model_len or tokens.stated_context_length(tokenizer, self.path(spec))
