"""The tenancy tests on a real PostgreSQL 15, which enforces the column lengths SQLite ignores: the store's and the
sensors' (tests/api/test_tenancy_store.py), the API's with two keys (tests/api/test_tenancy.py, the service's store
on PostgreSQL through BATCH_TEST_DATABASE_URL), and the parent-batch migration (0005)."""

from __future__ import annotations

import json

import pytest
from alembic import command
from sqlalchemy import select, text

from batch_dagster.db import BatchRecord, Database
from batch_dagster.db.session import alembic_config
from tests.api.conftest import start_service  # noqa: F401  (the API tests' fixture)
from tests.api.test_tenancy import (  # noqa: F401  (the tests, collected here again)
    test_a_batch_of_ten_thousand_bad_lines_is_a_small_object,
    test_a_gone_ancestor_is_named_by_its_id_not_by_where_it_was_stored,
    test_a_merged_chain_stops_at_another_owners_batch,
    test_a_retry_chain_of_ones_own_batches_still_merges,
    test_metadata_cannot_name_a_retry_parent,
    test_not_found_is_the_same_for_another_keys_object_and_for_none,
)
from tests.api.test_tenancy_store import (  # noqa: F401  (the tests, collected here again)
    store,
    test_a_drop_the_store_refuses_is_rolled_back_and_the_next_file_still_registers,
    test_a_dropped_file_whose_name_does_not_fit_is_refused_and_the_others_run,
    test_a_model_too_long_for_the_store_is_not_recorded_at_creation,
    test_one_batch_that_cannot_be_synced_stops_no_other,
    test_s3_keys_long_names_are_cut_and_too_long_keys_refused,
)


@pytest.fixture
def db_url(postgres_url) -> str:
    return postgres_url


@pytest.fixture(autouse=True)
def service_on_postgres(postgres_url, monkeypatch):
    """The API service of start_service keeps its store on PostgreSQL (tests.helpers.database_url reads this)."""
    monkeypatch.setenv("BATCH_TEST_DATABASE_URL", postgres_url)


def test_the_parent_batch_migration_on_postgres(postgres_url):
    command.upgrade(alembic_config(postgres_url), "0004")
    old = Database(postgres_url)
    with old.engine.begin() as connection:
        connection.execute(text("INSERT INTO api_keys (owner, created_at) VALUES ('a', 1), ('b', 1)"))
        for batch_id, owner, parent in (("a1", "a", None), ("a2", "a", "a1"), ("a3", "a", "b1"), ("b1", "b", None)):
            meta = json.dumps({"parent_batch_id": parent}) if parent else None
            connection.execute(text(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, "
                "request_total, request_completed, request_failed, metadata) VALUES "
                "(:id, :owner, '/v1/chat/completions', 'file-x', '24h', 'completed', 1, 0, 0, 0, CAST(:meta AS json))"),
                {"id": batch_id, "owner": owner, "meta": meta})
    old.upgrade()
    with old.session() as session:
        assert dict(session.execute(select(BatchRecord.id, BatchRecord.parent_batch_id)).all()) == {
            "a1": None, "a2": "a1", "a3": None, "b1": None}
    command.downgrade(alembic_config(postgres_url), "0004")
    old.dispose()
