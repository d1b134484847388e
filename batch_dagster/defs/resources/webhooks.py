"""Webhooks as a Dagster resource: the global endpoints, their secret and how hard delivery tries
(features/webhooks.py signs and sends)."""

from __future__ import annotations

import dagster as dg

from batch_dagster.features.webhooks import Post, Sender

from .fields import setting


class WebhookConfig(dg.ConfigurableResource):
    """The global endpoints (`urls`), the secret they are signed with, and how hard delivery tries.

    Owners' own endpoints are in the store, each with its own secret (features/webhooks.py).
    """

    urls: list[str] = setting("BATCH_WEBHOOK_URLS")
    secret: str = setting("BATCH_WEBHOOK_SECRET")
    timeout_s: float = 5.0
    max_attempts: int = 8
    first_backoff_s: float = 10.0  # then doubling: about 21 minutes between the first and the last attempt
    allow: list[str] = setting("BATCH_WEBHOOK_ALLOW")  # internal hosts owners' endpoints may reach

    def sender(self) -> Sender:
        return Sender(self.secret, self.timeout_s, list(self.allow))

    def send_all(self, posts: list[Post]) -> list[str | None]:
        """Sender.send_all: each POST's error, or None when a 2xx came back."""
        return self.sender().send_all(posts)
