"""A batch's options: the fields the create body adds to OpenAI's, declared once with their bounds.

The API's create body and Batch object take their option fields from `BatchOptions`; the store keeps the object
whole (the batch's `options` column); a retry batch inherits it. A new option is a field here, and the code that
acts on it.
"""

from __future__ import annotations

import logging
from typing import Any, Self

from pydantic import BaseModel, Field, ValidationError

from .contract import MAX_COST

MIN_PRIORITY, MAX_PRIORITY = -10, 10
log = logging.getLogger(__name__)


class BatchOptions(BaseModel):
    """What a batch's creator chose beyond OpenAI's create fields; each field's default is the batch without it.

    The openai SDK sends them in `extra_body`; the Batch object shows them beside OpenAI's fields.
    """

    # The launch order across the queue, higher first (the run queue's dagster/priority: features/fairness.py).
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # The cost cap: the most the batch's successful requests may cost, in the price table's currency
    # (features/cost_cap.py). None: uncapped.
    max_cost: float | None = Field(default=None, gt=0, le=MAX_COST, allow_inf_nan=False, strict=True)
    # Answer reuse: answers of deterministic requests taken from the answer store, billed at zero, and this batch's
    # kept there (features/reuse.py). None: as the operator's BATCH_REUSE_ANSWERS says.
    reuse: bool | None = Field(default=None, strict=True)
    # The error-rate breaker (batchfile/failure.py breaker_tripped): the share of failed lines among the batch's first
    # lines at which it stops. None: the operator's (BATCH_ERROR_BREAKER_RATE).
    error_breaker_rate: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, strict=True)

    @staticmethod
    def of(body: BatchOptions) -> BatchOptions:
        """The options of a model that has them among its fields (the create body), already checked."""
        return BatchOptions.model_construct(**{name: getattr(body, name) for name in BatchOptions.model_fields})

    def stored(self) -> dict[str, Any] | None:
        """What the store keeps: the options that differ from their defaults (None: none do)."""
        return self.model_dump(exclude_defaults=True) or None

    def to_dict(self) -> dict[str, Any]:
        """As a batch folder's document keeps them (batchfile/folder.py Declared): the stored form."""
        return self.stored() or {}

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
