"""/v1/keys: API keys managed by an admin key (create, list, change limits, rotate, revoke); 403 for any other key.

A key is shown once, in the answer that made it (create, rotate); the store keeps its SHA-256 only. A revoked or
rotated key is refused from its next request on.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field, StrictInt

from batch_dagster.db import keys as store
from batch_dagster.db.models import ApiKey
from batch_dagster.settings import KEY_NAME

from .deps import Admin, DbSession
from .errors import ADMIN_RESPONSES, ApiError, clip
from .schemas import Text

router = APIRouter(tags=["keys"], responses=ADMIN_RESPONSES)
Name = Annotated[str, Field(pattern=f"^{KEY_NAME.pattern}$", description="1 to 64 letters, digits, '.', '_' or '-'")]


class KeyLimits(BaseModel):
    """A key's own limits; null: the deployment's (BATCH_KEY_*); 0: no limit."""

    # Strict: JSON's `false` is not 0 (which would mean no limit).
    max_active_batches: StrictInt | None = Field(None, ge=0, lt=1 << 62)
    max_stored_bytes: StrictInt | None = Field(None, ge=0, lt=1 << 62)
    daily_budget: float | None = Field(None, ge=0, lt=1e15, strict=True)
    max_priority: StrictInt | None = Field(None, ge=-10, le=10)

    def stored(self) -> store.Limits:
        return store.Limits(**self.model_dump())


class CreateKeyRequest(BaseModel):
    name: Name
    admin: bool = False
    limits: KeyLimits = KeyLimits()


class UpdateKeyRequest(BaseModel):
    """The key's new limits (each one omitted or null: the deployment's), and its role when given."""

    admin: bool | None = None
    limits: KeyLimits = KeyLimits()


class KeyObject(BaseModel):
    object: Literal["api_key"] = "api_key"
    name: str
    admin: bool
    created_at: int
    created_by: str | None
    rotated_at: int | None
    revoked_at: int | None
    limits: KeyLimits


class KeyWithSecret(KeyObject):
    key: str = Field(description="The key itself: shown in this answer only.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyObject]


def key_object(row: ApiKey) -> KeyObject:
    limits = store.Limits.of(row)
    return KeyObject(name=row.name or store.UNNAMED, admin=row.admin, created_at=row.created_at,
                     created_by=row.created_by, rotated_at=row.rotated_at, revoked_at=row.revoked_at,
                     limits=KeyLimits(**vars(limits)))


def _done(action):
    """`action`'s result, or its KeyProblem as the API's error."""
    try:
        return action()
    except store.KeyProblem as exc:
        raise ApiError(exc.status, clip(str(exc), 300), param="name",
                       code={404: "not_found", 409: "conflict"}.get(exc.status, "invalid_key")) from None


@router.get("/keys", response_model=KeyList)
def list_keys(session: DbSession, _admin: Admin,
              include_revoked: Annotated[bool, Query()] = False) -> KeyList:
    """Every named key, oldest first (the revoked ones too with include_revoked=true)."""
    return KeyList(data=[key_object(r) for r in store.list_keys(session, revoked=include_revoked)])


@router.post("/keys", response_model=KeyWithSecret)
def create_key(body: CreateKeyRequest, session: DbSession, _admin: Admin) -> KeyWithSecret:
    """A new key (a new owner of files and batches) with its limits; the key is in this answer only."""
    row, key = _done(lambda: store.create(session, body.name, admin=body.admin, limits=body.limits.stored(),
                                          created_by="api"))
    return KeyWithSecret(**key_object(row).model_dump(), key=key)


@router.get("/keys/{name}", response_model=KeyObject)
def retrieve_key(name: Text, session: DbSession, _admin: Admin) -> KeyObject:
    return key_object(_done(lambda: store.get(session, name)))


@router.post("/keys/{name}", response_model=KeyObject)
def update_key(name: Text, body: UpdateKeyRequest, session: DbSession, _admin: Admin) -> KeyObject:
    """Replace the key's limits (and its role, when `admin` is given): its next request is held to them."""
    return key_object(_done(lambda: store.set_limits(session, name, body.limits.stored(), admin=body.admin)))


@router.post("/keys/{name}/rotate", response_model=KeyWithSecret)
def rotate_key(name: Text, session: DbSession, _admin: Admin) -> KeyWithSecret:
    """A new key for the same owner (its files, batches and limits stay); the old key is refused from now on."""
    row, key = _done(lambda: store.rotate(session, name))
    return KeyWithSecret(**key_object(row).model_dump(), key=key)


@router.post("/keys/{name}/revoke", response_model=KeyObject)
def revoke_key(name: Text, session: DbSession, _admin: Admin) -> KeyObject:
    """Refuse the key from its next request on; its batches still run and its files stay until they expire."""
    return key_object(_done(lambda: store.revoke(session, name)))
