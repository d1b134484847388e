"""The warm fleets `make serve` runs, as the store knows them: which models have work (a batch not ended, or an
interactive call: a fleet asleep wakes for it, one idle long enough sleeps), each fleet's state, router and last
start, and what a fleet not warm adds to its model's ETA."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batch_dagster.batchfile.status import TERMINAL, BatchStatus

from .models import BatchRecord, FleetRecord
from .repo import now

# Listed, so the status index serves the query (NOT IN would scan).
_NOT_ENDED = tuple(s for s in BatchStatus if s not in TERMINAL)


def busy_models(session: Session, models: Collection[str]) -> set[str]:
    """Those of `models` that have a batch not ended: created, waiting, running, finalizing or cancelling."""
    rows = session.scalars(select(BatchRecord.model).distinct().where(
        BatchRecord.status.in_(_NOT_ENDED), BatchRecord.model.in_(list(models))))
    return {m for m in rows if m}


def called_models(session: Session, models: Collection[str], since: int) -> set[str]:
    """Those of `models` whose fleet an interactive call wanted at or after `since` (unix seconds)."""
    return set(session.scalars(select(FleetRecord.model).where(
        FleetRecord.model.in_(list(models)), FleetRecord.called_at >= since)))


def record_call(session: Session, model: str) -> None:
    """An interactive call wants the model's fleet now (nothing when serve runs none for it); committed."""
    session.execute(update(FleetRecord).where(FleetRecord.model == model).values(called_at=now()))
    session.commit()


def fleet_records(session: Session) -> dict[str, FleetRecord]:
    """The fleets serve runs, by model."""
    return {f.model: f for f in session.scalars(select(FleetRecord))}


def record_fleet(session: Session, model: str, url: str, state: str, start_s: float | None = None) -> None:
    """Store the fleet's state (and, after a start, how long it took; else the last start's stays); committed."""
    row = session.get(FleetRecord, model)
    if row is None:
        row = FleetRecord(model=model, url=url, state=state, start_s=start_s, changed_at=now())
        session.add(row)
    else:
        row.url, row.state, row.changed_at = url, state, now()
        if start_s is not None:
            row.start_s = start_s
    session.commit()


def forget_fleets(session: Session) -> None:
    """No fleet runs (serve stopped, or started without them): their models' ETAs add nothing."""
    session.query(FleetRecord).delete()
    session.commit()


def start_delays(session: Session, at: float) -> dict[str, float]:
    """Per model whose fleet is asleep or starting, the seconds until its replicas answer: its last start's
    duration, less the time it has been starting."""
    delays = {}
    for f in session.scalars(select(FleetRecord).where(FleetRecord.state.in_(("asleep", "starting")))):
        took = f.start_s or 0.0
        delays[f.model] = took if f.state == "asleep" else max(took - (at - f.changed_at), 0.0)
    return delays
