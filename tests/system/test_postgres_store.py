"""The store's queries on a real PostgreSQL 15, which enforces what SQLite lets pass (types, JSON operators)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from batch_dagster.db import Database
from batch_dagster.db.models import Base
from batch_dagster.features.retention import first_batch_created_at
from tests.helpers import check_batch_filters, check_retention_queries


def test_batch_list_filters_on_postgres(postgres_url):
    database = Database(postgres_url)
    database.upgrade()
    try:
        with database.engine.connect() as connection:  # jsonb and its GIN index, as the models say
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        check_batch_filters(database)
    finally:
        database.dispose()


def test_retention_queries_on_postgres(postgres_url):
    database = Database(postgres_url)
    database.upgrade()
    try:
        check_retention_queries(database)
        assert first_batch_created_at(postgres_url) == 10  # read at definitions load, without the schema upgrade
    finally:
        database.dispose()
