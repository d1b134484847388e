"""The tenancy tests on a real PostgreSQL 15, which enforces the column lengths SQLite ignores: the store's and the
sensors' (tests/api/test_tenancy_store.py), the API's with two keys (tests/api/test_tenancy.py, the service's store
on PostgreSQL through BATCH_TEST_DATABASE_URL), the per-key limits under parallel clients (tests/api/
test_tenancy_limits.py: PostgreSQL's row locks, where SQLite has its one write lock), idempotent creates (tests/api/
test_idempotency.py: parallel repeats meet at PostgreSQL's unique index), the metrics' model labels (grouped in the
store), and the parent-batch migration (0005)."""

from __future__ import annotations

import pytest

from tests.api.conftest import start_service  # noqa: F401  (the API tests' fixture)
from tests.api.test_idempotency import (  # noqa: F401  (the tests, collected here again)
    test_a_key_is_its_owners_alone,
    test_a_repeat_is_never_counted_against_the_keys_limits,
    test_a_repeated_batch_create_answers_the_first_batch_and_another_body_is_a_409,
    test_a_repeated_upload_answers_the_first_file_and_stores_nothing_more,
    test_an_expired_key_is_free_again_and_the_retention_sensor_deletes_it,
    test_parallel_repeats_make_one_batch_and_one_file,
)
from tests.api.test_metrics import (  # noqa: F401  (the model labels, grouped by PostgreSQL)
    test_a_clients_model_names_never_become_labels,
)
from tests.api.test_store import check_the_options_migration, check_the_parent_batch_migration
from tests.api.test_tenancy import (  # noqa: F401  (the tests, collected here again)
    test_a_batch_of_ten_thousand_bad_lines_is_a_small_object,
    test_a_gone_ancestor_is_named_by_its_id_not_by_where_it_was_stored,
    test_a_merged_chain_stops_at_another_owners_batch,
    test_a_retry_chain_of_ones_own_batches_still_merges,
    test_metadata_cannot_name_a_retry_parent,
    test_not_found_is_the_same_for_another_keys_object_and_for_none,
)
from tests.api.test_tenancy_limits import (  # noqa: F401  (the races, on PostgreSQL's row locks)
    slow_store,
    test_a_batch_counts_its_own_input_copy_and_its_working_files,
    test_an_upload_past_the_keys_room_is_refused_from_its_declared_length,
    test_create_then_cancel_never_passes_the_active_batch_limit,
    test_parallel_creates_never_pass_the_active_batch_limit,
    test_parallel_uploads_never_pass_the_stored_bytes_limit,
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
    check_the_parent_batch_migration(postgres_url)


def test_the_options_migration_on_postgres(postgres_url):
    check_the_options_migration(postgres_url)
