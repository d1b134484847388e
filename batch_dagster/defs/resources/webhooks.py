"""Webhook endpoints as a Dagster resource, and the signed POST of one event (Standard Webhooks)."""

from __future__ import annotations

import asyncio
import binascii
from datetime import UTC, datetime
from typing import Any

import dagster as dg
import httpx
import orjson
from standardwebhooks import Webhook
from standardwebhooks.webhooks import EmptyWebhookSecretError

from batch_dagster import settings as s
from batch_dagster.db.webhooks import SECRET_PREFIX
from batch_dagster.egress import Allow, pinned

Post = tuple[str, str | None, str, bytes]  # url, the endpoint's secret (None: the global one), event id, body
_ERROR_BYTES = 200  # of an endpoint's error answer, kept with the attempt


def check_secret(secret: str) -> str | None:
    """What is wrong with a Standard Webhooks secret (`whsec_` and base64), or None."""
    if not secret.startswith(SECRET_PREFIX):
        return "BATCH_WEBHOOK_SECRET must start with 'whsec_' (a Standard Webhooks secret)."
    try:
        key = Webhook(secret)._whsecret  # the library's own decoding, as its verify() uses
    except (binascii.Error, ValueError, RuntimeError, EmptyWebhookSecretError) as exc:
        return f"BATCH_WEBHOOK_SECRET after 'whsec_' must be base64: {exc}"
    return None if len(key) >= 16 else "BATCH_WEBHOOK_SECRET must hold at least 16 bytes (24 base64 characters)."


def event_body(event_id: str, event_type: str, created_at: int, data: dict[str, Any]) -> bytes:
    """OpenAI's webhook event: {id, object: "event", type, created_at, data: {id, ...}}."""
    return orjson.dumps({"id": event_id, "object": "event", "type": event_type, "created_at": created_at,
                         "data": data})


class WebhookConfig(dg.ConfigurableResource):
    """The global endpoints (`urls`), the secret they are signed with, and how hard delivery tries.

    Owners' own endpoints are in the store, each with its own secret (store/webhooks.py).
    """

    urls: list[str] = list(s.default("BATCH_WEBHOOK_URLS"))
    secret: str = s.default("BATCH_WEBHOOK_SECRET")
    timeout_s: float = 5.0
    max_attempts: int = 8
    first_backoff_s: float = 10.0  # then doubling: about 21 minutes between the first and the last attempt
    allow: list[str] = list(s.default("BATCH_WEBHOOK_ALLOW"))  # BATCH_WEBHOOK_ALLOW: internal hosts endpoints may reach

    def headers(self, event_id: str, body: bytes, at: datetime | None = None, *,
                secret: str | None = None) -> dict[str, str]:
        """The Standard Webhooks headers (webhook-id, webhook-timestamp, webhook-signature), signed with `secret`
        (an owner's endpoint's) or else the global one."""
        at = at or datetime.now(UTC)
        signature = Webhook(secret or self.secret).sign(event_id, at, body.decode())
        return {"webhook-id": event_id, "webhook-timestamp": str(int(at.timestamp())),
                "webhook-signature": signature, "content-type": "application/json",
                "user-agent": "batch-dagster-webhooks"}

    def send_all(self, posts: list[Post]) -> list[str | None]:
        """POST each (url, secret or None for the global one, event_id, body) concurrently; per post None when a
        2xx came back, else why not.

        Each has `timeout_s` at most, in all, and reads at most a few hundred bytes of the answer, so a slow,
        dead or hostile endpoint delays nothing else and costs no memory.
        """
        return asyncio.run(self._send_all(posts))

    async def _send_all(self, posts: list[Post]) -> list[str | None]:
        allow = Allow.parse(self.allow)
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:

            async def post(url: str, secret: str | None, event_id: str, body: bytes) -> str | None:
                headers = self.headers(event_id, body, secret=secret)
                target, extensions = httpx.URL(url), dict[str, Any]()
                if secret is not None:  # an owner's endpoint (the operator's global ones are trusted)
                    target, extensions = await pinned(target, allow)
                    headers["host"] = httpx.URL(url).netloc.decode("ascii")
                async with client.stream("POST", target, content=body, headers=headers,
                                         extensions=extensions) as response:
                    if 200 <= response.status_code < 300:
                        return None
                    head = b""
                    async for chunk in response.aiter_bytes():
                        head += chunk
                        if len(head) >= _ERROR_BYTES:
                            break
                    return f"HTTP {response.status_code}: {head[:_ERROR_BYTES].decode(errors='replace')}"

            async def one(*post_args) -> str | None:
                try:
                    return await asyncio.wait_for(post(*post_args), self.timeout_s)
                except TimeoutError:
                    return f"no answer within {self.timeout_s} s"
                except Exception as exc:  # one endpoint's problem (a bad URL, a reset) stays its own
                    return f"{type(exc).__name__}: {exc}"

            return list(await asyncio.gather(*(one(*post) for post in posts)))


def webhooks_from_env(settings: s.Settings) -> WebhookConfig:
    from .pipeline import env_or

    # The secret stays an EnvVar, so the Dagster UI shows the variable's name, never its value.
    return WebhookConfig(urls=list(settings.webhook_urls),
                         secret=env_or("BATCH_WEBHOOK_SECRET", settings.webhook_secret),
                         allow=list(settings.webhook_allow))
