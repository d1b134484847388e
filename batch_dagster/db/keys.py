"""API keys in the store: each key's owner, name, role and limits, kept by the SHA-256 of the key (never the key).

The API looks a caller's key up here on every request, so a revoked or rotated key is refused from its next request
on, without a restart. The store is the truth: BATCH_API_KEYS seeds it when the API starts with the keys it has
never seen, and revokes a key the variable made that left it; it never makes a revoked or rotated key live again.
Keys made with `batch-dagster keys` or the admin endpoints stay until revoked.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, fields

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batch_dagster.settings import KEY_NAME, Settings

from .models import ApiKey
from .repo import ANONYMOUS, now, owner_of_key

PREFIX = "sk-batch-"  # what a key made here starts with (a key seeded from BATCH_API_KEYS is the operator's text)
UNNAMED = "unnamed"  # the label of an owner with no name (none is left once the API has started)
SEEDED = "BATCH_API_KEYS"  # the `created_by` of a key seeded from the variable


@dataclass(frozen=True)
class Limits:
    """A key's own limits; None: the deployment's (BATCH_KEY_MAX_ACTIVE_BATCHES, BATCH_KEY_MAX_STORED_BYTES,
    BATCH_KEY_DAILY_BUDGET, BATCH_KEY_MAX_PRIORITY); 0: no limit (for max_priority: only lower priorities)."""

    max_active_batches: int | None = None
    max_stored_bytes: int | None = None
    daily_budget: float | None = None
    max_priority: int | None = None

    def check(self) -> None:
        """ValueError naming the first limit out of bounds."""
        for name in ("max_active_batches", "max_stored_bytes"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1 << 62:
                raise ValueError(f"{name} must be a whole number, 0 (no limit) or more")
        if self.daily_budget is not None and not 0 <= self.daily_budget < 1e15:
            raise ValueError("daily_budget must be a number, 0 (no budget) or more")
        if self.max_priority is not None and not -10 <= self.max_priority <= 10:
            raise ValueError("max_priority must be from -10 to 10")

    @classmethod
    def of(cls, row: ApiKey) -> Limits:
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Caller:
    """Who a request's key belongs to: the owner its rows are stored under, its name, whether it is an admin, and
    its own limits."""

    owner: str
    name: str
    admin: bool = False
    limits: Limits = Limits()


ANONYMOUS_CALLER = Caller(ANONYMOUS, ANONYMOUS, admin=True)  # no keys configured: loopback only, all allowed


class KeyProblem(ValueError):
    """A key operation that cannot be done, said plainly: `status` is the HTTP status the API answers it with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def new_key() -> str:
    """A new key: 256 random bits."""
    return PREFIX + secrets.token_urlsafe(32)


def check_name(name: str) -> str:
    if not KEY_NAME.fullmatch(name):
        raise KeyProblem("a key's name must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a "
                         "digit")
    return name


def keyed(session: Session) -> bool:
    """Whether the store has ever held a key (revoked ones count): then every request needs a live one. Only a store
    that never had one takes requests without a key (loopback only), so revoking the last key never opens the API."""
    return session.scalar(select(ApiKey.owner).where(ApiKey.key_hash.is_not(None)).limit(1)) is not None


def authenticate(session: Session, key: str) -> Caller | None:
    """The caller whose live key `key` is; None for a key unknown, revoked or rotated away."""
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == owner_of_key(key), ApiKey.revoked_at.is_(None)))
    return None if row is None else caller(row)


def caller(row: ApiKey) -> Caller:
    return Caller(row.owner, row.name or UNNAMED, row.admin, Limits.of(row))


def get(session: Session, name: str) -> ApiKey:
    row = session.scalar(select(ApiKey).where(ApiKey.name == name))
    if row is None:
        raise KeyProblem(f"no key is named {name!r}", 404)
    return row


def list_keys(session: Session, *, revoked: bool = False) -> list[ApiKey]:
    """Every named key, oldest first; the revoked ones too when `revoked`."""
    query = select(ApiKey).where(ApiKey.name.is_not(None))
    if not revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list(session.scalars(query.order_by(ApiKey.created_at, ApiKey.name)))


def create(session: Session, name: str, *, admin: bool = False, limits: Limits = Limits(),
           created_by: str = "cli") -> tuple[ApiKey, str]:
    """A new key named `name` (a new owner); the row and the key, which is shown once and never stored."""
    check_name(name)
    limits.check()
    if session.scalar(select(ApiKey.owner).where(ApiKey.name == name)) is not None:
        raise KeyProblem(f"a key named {name!r} exists already (revoked keys keep their names)", 409)
    key = new_key()
    row = ApiKey(owner=owner_of_key(key), name=name, key_hash=owner_of_key(key), admin=admin, created_at=now(),
                 created_by=created_by, **{f.name: getattr(limits, f.name) for f in fields(Limits)})
    session.add(row)
    session.commit()
    return row, key


def revoke(session: Session, name: str) -> ApiKey:
    """Revoke the key named `name`: refused from its next request on. Its files and batches stay (and run)."""
    row = get(session, name)
    if row.revoked_at is None:
        row.revoked_at = now()
        session.commit()
    return row


def rotate(session: Session, name: str) -> tuple[ApiKey, str]:
    """A new key for the owner named `name`, which keeps its files, batches and limits; the old key is refused
    from its next request on."""
    row = get(session, name)
    if row.revoked_at is not None:
        raise KeyProblem(f"the key named {name!r} is revoked; create a new one", 409)
    key = new_key()
    row.key_hash, row.rotated_at = owner_of_key(key), now()
    session.commit()
    return row, key


def set_limits(session: Session, name: str, limits: Limits, *, admin: bool | None = None) -> ApiKey:
    """Replace the limits of the key named `name` (None in `limits`: back to the deployment's); its role too when
    `admin` is given."""
    limits.check()
    row = get(session, name)
    for f in fields(Limits):
        setattr(row, f.name, getattr(limits, f.name))
    if admin is not None:
        row.admin = admin
    session.commit()
    return row


def seed(session: Session, entries: Iterable[tuple[str | None, str]]) -> list[str]:
    """Add BATCH_API_KEYS' (name or None, key) entries to the store, which stays the truth: a key it has never seen
    is made live under its owner (named as the entry names it; a bare key gets a random name), a key the variable
    made is renamed as its entry says, and one it made that left the variable is revoked. A key revoked or rotated
    (`batch-dagster keys`, /v1/keys, or by leaving the variable) is never made live again, and a key made otherwise
    is left as it is. No entries (the variable unset): nothing is added or revoked, the store's keys are all there
    are. Roles and limits are the store's (`batch-dagster keys limits`). The names of the entries that did nothing
    because their key was revoked or rotated; KeyProblem when an entry names a key made otherwise."""
    dead: list[str] = []
    seeded: set[str] = set()
    for name, key in entries:
        owner = owner_of_key(key)
        seeded.add(owner)
        row = session.get(ApiKey, owner)
        if row is not None and (row.revoked_at is not None or row.key_hash not in (None, owner)):
            dead.append(row.name or name or UNNAMED)  # revoked, or rotated to another key: the store says so
            continue
        if row is None:
            row = ApiKey(owner=owner, created_at=now())
            session.add(row)
        if row.key_hash is None:  # an owner that never had a key (its rows older than the keys' table)
            row.key_hash, row.created_by = owner, SEEDED
        if name is not None and row.name != name and row.created_by == SEEDED:
            _take_name(session, name, owner)
            row.name = name
    if seeded:
        session.flush()
        # Only a key the variable made, and still its own (not rotated): a rotated key is the store's now.
        session.execute(update(ApiKey).where(ApiKey.created_by == SEEDED, ApiKey.owner.not_in(seeded),
                                             ApiKey.key_hash == ApiKey.owner, ApiKey.revoked_at.is_(None))
                        .values(revoked_at=now()))
    name_unnamed(session)
    session.commit()
    return dead


def brought_back(session: Session) -> list[str]:
    """The names of the keys seeded from BATCH_API_KEYS that were rotated but hold their first key again: before the
    store was the truth, seeding the variable again undid a rotation (the new key lost, the old one live). Rotating
    such a key again gives its owner a new key, files and batches kept."""
    return list(session.scalars(select(ApiKey.name).where(
        ApiKey.created_by == SEEDED, ApiKey.rotated_at.is_not(None), ApiKey.key_hash == ApiKey.owner,
        ApiKey.revoked_at.is_(None)).order_by(ApiKey.name)))


def _take_name(session: Session, name: str, owner: str) -> None:
    """Free `name` for the seeded key of `owner`: KeyProblem when a key made otherwise has it; an earlier entry's
    owner that had it gives it up (its rows stay its own)."""
    clash = session.scalar(select(ApiKey).where(ApiKey.name == name, ApiKey.owner != owner))
    if clash is not None and clash.created_by not in (SEEDED, None):
        session.rollback()
        raise KeyProblem(f"BATCH_API_KEYS names a key {name!r}, the name of a key made with `batch-dagster keys`: "
                         "rename the entry, or revoke and rename that key")
    if clash is not None:
        clash.name = None
        session.flush()


def name_unnamed(session: Session) -> None:
    """Give every owner with no name a random one (`key-` and 12 hex digits): it says nothing about its key, and
    it stays what the metrics and the Dagster UI show for the owner."""
    for row in session.scalars(select(ApiKey).where(ApiKey.name.is_(None), ApiKey.owner != ANONYMOUS)):
        row.name = f"key-{secrets.token_hex(6)}"
    session.flush()


def _own(mine, deployment):
    """A key's own limit, else the deployment's; the key's 0 is no limit (None)."""
    return deployment if mine is None else mine or None


def own_daily_budget(session: Session, owner: str, deployment: float | None) -> float | None:
    """The daily budget the owner's batches are held to: its key's own, else the deployment's; None: no budget."""
    row = session.get(ApiKey, owner)
    return _own(None if row is None else row.daily_budget, deployment)


def limits_of(session: Session, owner: str, config: Settings) -> Limits:
    """The limits the owner is held to: its key's own, else the deployment's; None where there is no limit."""
    row = session.get(ApiKey, owner)
    own = Limits() if row is None else Limits.of(row)
    return Limits(_own(own.max_active_batches, config.key_max_active_batches),
                  _own(own.max_stored_bytes, config.key_max_stored_bytes),
                  _own(own.daily_budget, config.key_daily_budget),
                  config.key_max_priority if own.max_priority is None else own.max_priority)


def labels(session: Session) -> dict[str, str]:
    """Every owner's name, by owner: what the metrics and the Dagster UI show for it."""
    return {owner: name or (ANONYMOUS if owner == ANONYMOUS else UNNAMED)
            for owner, name in session.execute(select(ApiKey.owner, ApiKey.name))}
