"""bench/scale.py's seeding: the bulk rows are batches the store's own queries see as the API and sensors would."""

from __future__ import annotations

from sqlalchemy import func, select

from batch_dagster.db import Database, repo
from batch_dagster.db.models import BatchRecord, FileRecord
from bench.scale import keys_and_owners, seed_batches


def test_seeded_batches_are_listed_per_owner_and_queued_ones_wait_for_the_launch_sensor(tmp_path):
    store = Database(f"sqlite:///{tmp_path / 'api.db'}")
    store.upgrade()
    _, owners = keys_and_owners(7)
    done = seed_batches(store, owners, 120)
    queued = seed_batches(store, owners, 30, status="validating", launched=False, start=1000)
    assert len(done) == 120 and len(queued) == 30 and len({b for _, b in done + queued}) == 150
    with store.session() as session:
        assert session.scalar(select(func.count()).select_from(BatchRecord)) == 150
        assert session.scalar(select(func.count()).select_from(FileRecord)) == 150
        # Spread over the owners (by row number): each owner's list holds exactly its rows, newest first.
        mine = [b for o, b in done + queued if o == owners[0]]
        assert 18 <= len(mine) <= 24
        listed = repo.list_batches(session, owners[0], after=None, limit=100)
        assert listed is not None
        rows, more = listed
        assert ([r.id for r in rows], more) == (mine[::-1], False)
        assert {b.id for b in repo.batches_to_launch(session, limit=100)} == {b for _, b in queued}
        assert repo.active_batches(session) == []
