"""What every route needs: the app's context (config, store, storage), a session, and the caller's identity."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from batch_dagster.db.repo import ANONYMOUS

from .context import AppContext
from .errors import ApiError


def get_context(request: Request) -> AppContext:
    return request.app.state.context


def get_session(ctx: Annotated[AppContext, Depends(get_context)]) -> Iterator[Session]:
    with ctx.db.session() as session:
        yield session


def owner_of_header(authorization: str, owners: dict[str, str]) -> str:
    """The owner of the key in an Authorization header (ApiError 401 without a right key)."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                       code="missing_api_key")
    owner = None
    for key, key_owner in owners.items():
        # Compare with every key, in constant time, so timing says nothing about which one matched.
        if hmac.compare_digest(token.encode(errors="replace"), key.encode()):
            owner = key_owner
    if owner is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return owner


def get_owner(request: Request, ctx: Annotated[AppContext, Depends(get_context)]) -> str:
    """The owner of the caller's key; everyone is one anonymous owner when no keys are configured."""
    if not ctx.owners:
        return ANONYMOUS
    return owner_of_header(request.headers.get("authorization", ""), ctx.owners)


Context = Annotated[AppContext, Depends(get_context)]
DbSession = Annotated[Session, Depends(get_session)]
Owner = Annotated[str, Depends(get_owner)]
