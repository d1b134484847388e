"""The API under load through `python -m batch_dagster.serve`: 32 clients creating, listing and retrieving, on
SQLite and on PostgreSQL, with no 5xx and no lock error (a short run of bench/api_load.py; `make bench-api` runs
the full minute)."""

from __future__ import annotations

import pytest

from bench.api_load import run_on

CLIENTS, SECONDS = 32, 10


def assert_held(summary: dict) -> None:
    assert summary["server_errors"] == 0 and summary["errors"] == 0, summary["first_errors"]
    assert summary["log_locked"] == 0
    ops = summary["operations"]
    assert set(ops) == {"upload", "create", "list_batches", "retrieve_batch", "list_files", "retrieve_file"}
    for op, stats in ops.items():
        assert stats["statuses"] == {"200": stats["count"]}, (op, stats)
    assert ops["create"]["count"] >= CLIENTS and summary["requests"] > 200


@pytest.mark.timeout(300)
def test_load_on_sqlite():
    assert_held(run_on("sqlite", clients=CLIENTS, duration_s=SECONDS, max_requests=20_000))


@pytest.mark.timeout(300)
def test_load_on_postgres(postgres_url):
    # The session's PostgreSQL 15 (tests/system/conftest.py), a new database; the store's driver is psycopg 3.
    url = postgres_url.replace("+psycopg2://", "+psycopg://")
    assert_held(run_on("postgres", clients=CLIENTS, duration_s=SECONDS, max_requests=20_000, database_url=url))
