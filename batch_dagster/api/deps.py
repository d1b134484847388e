"""What every route needs: the app's context (config, store, storage), a session, and the caller's identity."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from batch_dagster.db import keys
from batch_dagster.db.keys import ANONYMOUS_CALLER, Caller

from .context import AppContext
from .errors import ApiError


def get_context(request: Request) -> AppContext:
    return request.app.state.context


def get_session(ctx: Annotated[AppContext, Depends(get_context)]) -> Iterator[Session]:
    with ctx.db.session() as session:
        yield session


def caller_of_header(authorization: str, ctx: AppContext) -> Caller:
    """Who calls with this Authorization header: the live key's caller, or everyone's anonymous caller while the
    store has never held a key. ApiError 401 without a live key. A blocking store read: the guard calls it in a
    worker thread."""
    with ctx.db.session() as session:
        if not ctx.keyed:
            ctx.keyed = keys.keyed(session)
            if not ctx.keyed:
                return ANONYMOUS_CALLER
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                           code="missing_api_key")
        # Looked up by its SHA-256 (an index): timing says nothing of any stored key.
        caller = keys.authenticate(session, token)
    if caller is None:
        raise ApiError(401, "Incorrect API key provided, or a key that was revoked or rotated.",
                       code="invalid_api_key")
    return caller


def get_caller(request: Request) -> Caller:
    """The caller the guard found for this request (RequestGuard checks every /v1 request's key first)."""
    return request.state.caller


def get_owner(caller: Annotated[Caller, Depends(get_caller)]) -> str:
    """The owner the caller's rows are stored under."""
    return caller.owner


def get_admin(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:
    """The caller, if an admin key; ApiError 403 otherwise."""
    if not caller.admin:
        raise ApiError(403, "Managing API keys needs an admin key (`batch-dagster keys create NAME --admin`).",
                       type="permission_error", code="admin_key_required")
    return caller


Context = Annotated[AppContext, Depends(get_context)]
DbSession = Annotated[Session, Depends(get_session)]
CallerDep = Annotated[Caller, Depends(get_caller)]
Owner = Annotated[str, Depends(get_owner)]
Admin = Annotated[Caller, Depends(get_admin)]
