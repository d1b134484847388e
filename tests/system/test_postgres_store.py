"""The store's queries on a real PostgreSQL 15, which enforces what SQLite lets pass (types, JSON operators)."""

from __future__ import annotations

from batch_dagster.db import Database
from tests.helpers import check_batch_filters


def test_batch_list_filters_on_postgres(postgres_url):
    database = Database(postgres_url)
    database.upgrade()
    try:
        check_batch_filters(database)
    finally:
        database.dispose()
