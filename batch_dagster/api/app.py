"""The FastAPI app: OpenAI-compatible /v1/files and /v1/batches over the store and the pipeline's storage, and the
interactive endpoints forwarded to the models' warm fleets."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from batch_dagster.db import keys, repo
from batch_dagster.settings import Settings, split_key

from . import batches, errors, files, interactive, message_batches, metrics, webhook_endpoints
from . import keys as key_routes
from .anthropic_shape import AnthropicShape
from .context import AppContext
from .guard import RequestGuard
from .launch_nudge import LaunchNudge

log = logging.getLogger("batch_dagster.api")


def create_app(config: Settings, launch_nudge: str | None = None) -> FastAPI:
    """Build the app; the store's schema is upgraded to head and BATCH_API_KEYS' new keys seeded into it here, before
    the first request (KeyProblem when an entry names a key made with `batch-dagster keys`). `launch_nudge`: the
    socket serve's daemon listens on for new batches (api/launch_nudge.py)."""
    context = AppContext.build(config)
    context.launches = LaunchNudge(launch_nudge)
    context.db.upgrade()
    with context.db.session() as session:
        repo.ensure_owners(session, [repo.ANONYMOUS])
        for name in keys.seed(session, map(split_key, config.api_keys)):
            log.warning("BATCH_API_KEYS names the key %r, which was revoked or rotated in the store: it stays "
                        "refused (the store is the truth); remove its entry", name)
        for name in keys.brought_back(session):
            log.warning("The key %r was rotated, but an earlier version seeding BATCH_API_KEYS made its old key live "
                        "again: rotate it again (`batch-dagster keys rotate %s`) to refuse the old key", name, name)
        context.keyed = keys.keyed(session)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await interactive.close(_app)
        context.close()

    app = FastAPI(
        title="batch-dagster",
        summary="OpenAI-compatible Files, Batches and webhook endpoints; batches run through the Dagster pipeline.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.context = context
    errors.install(app)
    app.include_router(files.router, prefix="/v1")
    app.include_router(batches.router, prefix="/v1")
    app.include_router(message_batches.router, prefix="/v1")
    app.include_router(webhook_endpoints.router, prefix="/v1")
    app.include_router(key_routes.router, prefix="/v1")

    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    metrics.install(app, context)
    interactive.install(app, context)  # its metrics in the registry metrics.install made
    app.add_middleware(RequestGuard, context=context)
    app.add_middleware(AnthropicShape)  # outside the guard: its key header read, and its errors shaped, too
    app.openapi = _documented(app, config)  # type: ignore[method-assign]
    return app


def _documented(app: FastAPI, config: Settings):
    """The OpenAPI document without FastAPI's 422 (request validation errors are 400: errors.py), and with the
    completion windows this service offers as `completion_window`'s enum."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()  # cached by FastAPI after the first call; the edits below are idempotent
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        window = components.get("CreateBatchRequest", {}).get("properties", {}).get("completion_window")
        if window is not None:
            window["enum"] = list(config.windows.names)
        return schema

    return openapi
