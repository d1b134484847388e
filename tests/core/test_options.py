"""A batch's options: bounded once, kept whole by the store (only what differs from the defaults), read back
whatever a row holds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from batch_dagster.batchfile.options import MAX_PRIORITY, BatchOptions


def test_the_bounds_refuse_what_the_create_body_refuses():
    for bad in ({"priority": MAX_PRIORITY + 1}, {"max_cost": 0}, {"max_cost": "1"}, {"max_cost": float("inf")}):
        with pytest.raises(ValidationError):
            BatchOptions.model_validate(bad)


def test_the_store_keeps_only_what_differs_from_the_defaults():
    assert BatchOptions().stored() is None
    assert BatchOptions(priority=3).stored() == {"priority": 3}
    kept = BatchOptions(priority=-1, max_cost=2.5)
    assert BatchOptions.from_stored(kept.stored()) == kept


def test_a_stored_option_the_bounds_refuse_is_read_as_its_default():
    assert BatchOptions.from_stored({"priority": 99, "max_cost": 1.5}) == BatchOptions(max_cost=1.5)
    assert BatchOptions.from_stored(None) == BatchOptions.from_stored(["not", "a", "dict"]) == BatchOptions()
    assert BatchOptions.from_stored({"priority": 2, "unknown": 1}) == BatchOptions(priority=2)  # a newer writer's


def test_options_left_unset_take_the_defaults_given_once():
    operator = BatchOptions(reuse=True, error_breaker_rate=0.5)
    assert BatchOptions().resolved(operator) == BatchOptions(reuse=True, error_breaker_rate=0.5)
    own = BatchOptions(priority=3, reuse=False, max_cost=2.0)
    assert own.resolved(operator) == BatchOptions(priority=3, reuse=False, max_cost=2.0, error_breaker_rate=0.5)
    assert BatchOptions().resolved(BatchOptions()) == BatchOptions()
