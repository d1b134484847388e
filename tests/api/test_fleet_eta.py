"""A warm fleet asleep or starting delays its model's queue by its last start (serve/fleets.py records it), and each
batch keeps the first end it was given, which the metrics measure the ETA's error against."""

from __future__ import annotations

from batch_dagster.db import BatchRecord
from batch_dagster.db.fleets import record_fleet
from batch_dagster.db.models import FleetRecord
from batch_dagster.features.eta import refresh_queue
from tests.api.test_queue_store import NOW, add
from tests.api.test_queue_store import session as session  # noqa: F401 - the store fixture, shared


def ends(store) -> dict[str, int]:
    return {b.id: b.estimated_completion_at for b in store.query(BatchRecord)}


def test_a_sleeping_fleets_start_is_counted_in_its_models_eta_and_the_first_eta_stays(session):  # noqa: F811
    add(session, "embed", "validating", model="e", file="f1000")
    add(session, "chat", "validating", model="c", file="f1000")
    refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW)
    warm = ends(session)
    record_fleet(session, "e", "http://127.0.0.1:1", "asleep", start_s=40.0)
    refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW)
    assert ends(session)["embed"] == warm["embed"] + 40 and ends(session)["chat"] == warm["chat"]  # its own model
    row = session.get(FleetRecord, "e")
    row.state, row.changed_at = "starting", NOW - 30  # starting for 30 s of its 40: 10 s left
    session.commit()
    refresh_queue(session, slots=1, default_tokens_per_s=250.0, now=NOW)
    assert ends(session)["embed"] == warm["embed"] + 10
    assert {b.id: b.first_estimated_completion_at for b in session.query(BatchRecord)} == warm  # the first stays
