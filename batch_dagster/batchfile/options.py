"""What a batch's creator asked: the batch request (`BatchRequest`), and its options (`BatchOptions`, the fields
the create body adds to OpenAI's, declared once with their bounds).

Every way in (the API, a dropped file, the command line, a retry, a table batch) builds a BatchRequest; the store
keeps it whole, on the batch's row and in its folder's batch.json alike; the Batch object shows it. The API's create
body and Batch object and the table batch component take their option fields from `BatchOptions`. A new option is a
field here, and the code that acts on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Self

from pydantic import BaseModel, Field, StrictBool, StrictFloat, ValidationError

from .contract import MAX_COST
from .windows import Window

MIN_PRIORITY, MAX_PRIORITY = -10, 10
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on a batch's metadata
log = logging.getLogger(__name__)


class BatchOptions(BaseModel):
    """What a batch's creator chose beyond OpenAI's create fields; each field's default is the batch without it.

    The openai SDK sends them in `extra_body`; the Batch object shows them beside OpenAI's fields.
    """

    # The run queue's dagster/priority (features/fairness.py).
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description=(
        "The launch order across the queue, higher first."))
    # features/cost_cap.py.
    max_cost: StrictFloat | None = Field(default=None, gt=0, le=MAX_COST, allow_inf_nan=False, description=(
        "The most the batch's successful requests may cost, in the price table's currency: refused above it at "
        "validation, stopped there while it runs. Unset: uncapped."))
    # features/reuse.py.
    reuse: StrictBool | None = Field(default=None, description=(
        "Reuse the answers of deterministic requests asked before (an embedding, temperature 0 or a seed) from the "
        "answer store, billed at zero, and keep this batch's there. Unset: as the operator says "
        "(BATCH_REUSE_ANSWERS)."))
    # batchfile/failure.py breaker_tripped.
    error_breaker_rate: StrictFloat | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, description=(
        "The share of failed lines among the batch's first lines at which it stops. Unset: the operator's "
        "(BATCH_ERROR_BREAKER_RATE)."))
    # features/breaker.py.
    error_breaker_structured: StrictBool | None = Field(default=None, description=(
        "Whether the breaker also counts, as failed, the completed lines whose structured answer is not what they "
        "asked (request_counts.invalid_structured and incomplete_structured): a labelling batch whose answers break "
        "their schema stops as one whose lines fail would. Unset: no."))

    @staticmethod
    def of(body: BatchOptions) -> BatchOptions:
        """The options of a model that has them among its fields (the create body), already checked."""
        return BatchOptions.model_construct(**{name: getattr(body, name) for name in BatchOptions.model_fields})

    def stored(self) -> dict[str, Any] | None:
        """What the store keeps: the options that differ from their defaults (None: none do)."""
        return self.model_dump(exclude_defaults=True) or None

    def to_dict(self) -> dict[str, Any]:
        """As a batch folder's batch.json keeps them (BatchRequest.to_dict): the stored form."""
        return self.stored() or {}

    def resolved(self, defaults: BatchOptions) -> BatchOptions:
        """These options with each one left unset (None) taken from `defaults` (the operator's, or a table batch's):
        what the pipeline acts on, resolved once per run."""
        unset = {name: getattr(defaults, name) for name in type(self).model_fields if getattr(self, name) is None}
        return self.model_copy(update=unset)

    @classmethod
    def from_stored(cls, data: object) -> Self:
        """The options a row holds. Whatever it holds (a value from an older bound, another writer's), reading
        never fails: an option the bounds refuse is read as its default, and logged."""
        if not isinstance(data, dict):
            return cls()
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            refused = {str(error["loc"][0]) for error in exc.errors() if error["loc"]}
            log.warning("Stored batch options the bounds refuse, read as their defaults: %.200r", data)
            return cls.model_validate({k: v for k, v in data.items() if k not in refused})


@dataclass(frozen=True)
class BatchRequest:
    """A batch as its creator asked for it, whichever way it came in: each way in builds one, the store keeps it
    whole (the batch's row and its folder's batch.json), and the Batch object shows it.

    `owner`: an API key's owner, or a table batch's namespace (features/scope.py); empty when not known.
    `input_file_id`: its input's File (None: a table batch's input, which is in its folder alone). `endpoint` and
    `model` None: the input's first request says (the store reads it). `window`: the completion window, whose length
    sets the deadline (None: no deadline, as on the command line). `output_expires_after`: seconds after which the
    output and error files expire (None: kept until deleted). `parent_batch_id`: the batch a retry retries.
    """

    owner: str = ""
    input_file_id: str | None = None
    endpoint: str | None = None
    model: str | None = None
    window: Window | None = None
    metadata: dict[str, Any] | None = None
    output_expires_after: int | None = None
    options: BatchOptions = field(default_factory=BatchOptions)
    parent_batch_id: str | None = None

    @property
    def completion_window(self) -> str | None:
        """The window's name, which prices the batch (None: no window)."""
        return self.window.name if self.window is not None else None

    def to_dict(self) -> dict[str, Any]:
        """As the batch's folder keeps it: the window as its name and its length when created."""
        return {"owner": self.owner, "input_file_id": self.input_file_id, "endpoint": self.endpoint,
                "model": self.model, "completion_window": self.completion_window,
                "window_s": self.window.seconds if self.window is not None else None, "metadata": self.metadata,
                "output_expires_after": self.output_expires_after, "options": self.options.to_dict(),
                "parent_batch_id": self.parent_batch_id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchRequest:
        """As the folder keeps it. A folder written before the request was kept whole holds its endpoint and window
        (whose length then reads 0), and a table batch's options and owner."""
        name = data.get("completion_window")
        return cls(owner=data.get("owner") or "", input_file_id=data.get("input_file_id"),
                   endpoint=data.get("endpoint"), model=data.get("model"),
                   window=Window(name, int(data.get("window_s") or 0)) if name else None,
                   metadata=data.get("metadata"), output_expires_after=data.get("output_expires_after"),
                   options=BatchOptions.from_stored(data.get("options")),
                   parent_batch_id=data.get("parent_batch_id"))
