"""What each key holds, as its limits count it (features/quotas.py), on SQLite and on a real PostgreSQL 15 (issue #18):
only the key's own rows, batches that have not ended (nor are being cancelled), files that have not expired and what
its batches' folders keep beside them."""

from __future__ import annotations

import pytest

from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.features.quotas import active_batches, stored_bytes


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    url = (f"sqlite:///{tmp_path / 'api.db'}" if request.param == "sqlite"
           else request.getfixturevalue("postgres_url"))
    db = Database(url)
    db.upgrade()
    yield db
    db.dispose()


def test_the_limits_count_the_keys_own_unfinished_batches_and_kept_files(database):
    a, b, now = repo.owner_of_key("sk-a"), repo.owner_of_key("sk-b"), repo.now()
    with database.session() as session:
        repo.ensure_owners(session, [a, b])
        for i, (owner, status) in enumerate([(a, "validating"), (a, "in_progress"), (a, "cancelling"),
                                             (a, "completed"), (a, "failed"), (b, "in_progress")]):
            session.add(BatchRecord(id=f"batch_{i}", owner=owner, endpoint="/v1/chat/completions",
                                    input_file_id="file-x", completion_window="24h", status=status, created_at=now,
                                    stored_bytes=1000 if owner == a else 0))
        for i, (owner, size, expires_at) in enumerate([(a, 100, None), (a, 20, now + 3600), (a, 7, now - 1),
                                                       (b, 1000, None)]):
            session.add(FileRecord(id=f"file-{i}", owner=owner, bytes=size, created_at=now, expires_at=expires_at,
                                   filename="in.jsonl", purpose="batch", path=f"files/file-{i}"))
        session.commit()
        # A cancelling batch still holds its run until the run stops, so it counts (#45).
        assert (active_batches(session, a), active_batches(session, b)) == (3, 1)
        # The expired file is not kept; every batch's folder is, ended or not.
        assert (stored_bytes(session, a), stored_bytes(session, b)) == (120 + 5 * 1000, 1000)
        assert (active_batches(session, "nobody"), stored_bytes(session, "nobody")) == (0, 0)
