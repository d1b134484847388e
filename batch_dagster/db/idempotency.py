"""Idempotency keys in the store: the live key an owner sent before, and the claim of a new one in the transaction
that makes its object, which the unique (owner, key) lets only one request commit."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from . import repo
from .models import IdempotencyRecord


@dataclass(frozen=True)
class Used:
    """What a key was first sent with and what it made."""

    route: str
    fingerprint: str
    object_id: str


class Taken(Exception):
    """Another request claimed the key first (it committed, or is committing, its own object)."""


def find(session: Session, owner: str, key: str) -> Used | None:
    """The owner's key, if it was sent before and has not expired."""
    row = session.scalar(select(IdempotencyRecord).where(
        IdempotencyRecord.owner == owner, IdempotencyRecord.key == key, IdempotencyRecord.expires_at > repo.now()))
    return None if row is None else Used(row.route, row.fingerprint, row.object_id)


def claim(session: Session, owner: str, key: str, used: Used, ttl_s: int) -> None:
    """Add the key, in the session's transaction (the caller adds the object and commits); Taken when another
    request has it. An expired row of the key goes first: the key is free again once its time is up."""
    at = repo.now()
    session.execute(delete(IdempotencyRecord).where(
        IdempotencyRecord.owner == owner, IdempotencyRecord.key == key, IdempotencyRecord.expires_at <= at))
    session.add(IdempotencyRecord(owner=owner, key=key, route=used.route, fingerprint=used.fingerprint,
                                  object_id=used.object_id, created_at=at, expires_at=at + ttl_s))
    try:
        # PostgreSQL waits here for a transaction that inserted the same key to end; SQLite for the write lock.
        session.flush()
    except IntegrityError as exc:
        raise Taken() from exc

