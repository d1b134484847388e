"""The tests' Dagster instance says which test leaves a Dagster context open past it.

CI failed on f85e33d in three tests that load definitions ("unable to open database file", "Attempted to resolve
undefined DagsterInstance weakref"): an earlier test in the same worker had built an input context without `with`.
It entered an ephemeral instance inside the test's own, and the garbage collector closed it only after the test's
instance had closed, setting Dagster's ambient state storage back to that closed instance's."""

from __future__ import annotations

import dagster as dg
import pytest
from dagster._core.storage.defs_state.base import DefsStateStorage, _current_storage

from tests.helpers import dagster_instance


def test_a_context_left_open_inside_the_instance_fails_the_test_that_left_it():
    before = DefsStateStorage.get()
    try:
        with pytest.raises(AssertionError, match="still open as the instance closes"):
            with dagster_instance() as instance:
                closed = instance.defs_state_storage
                # Kept past the instance, as a reference cycle keeps one until the collector runs.
                left_open = dg.build_input_context(asset_key=dg.AssetKey("t"))
        left_open.__exit__(None, None, None)  # what the collector would do later: the closed instance is back
        assert DefsStateStorage.get() is closed
    finally:
        _current_storage.set(before)


def test_a_context_in_a_with_block_leaves_the_ambient_storage_as_it_was():
    before = DefsStateStorage.get()
    with dagster_instance() as instance:
        with dg.build_input_context(asset_key=dg.AssetKey("t"), instance=instance):
            pass
    assert DefsStateStorage.get() is before
