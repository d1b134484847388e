"""Webhooks: each batch that ended is POSTed, signed, to every global endpoint and to its owner's subscribed
endpoints; failed attempts are retried with backoff (features/webhooks.py)."""

from __future__ import annotations

from urllib.parse import urlsplit

import dagster as dg

from batch_dagster.defs.resources import DatabaseResource
from batch_dagster.defs.resources.setting_fields import setting
from batch_dagster.defs.sensor_timing import timed
from batch_dagster.features.webhooks import Post, Sender, check_secret, deliver_due


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


@dg.sensor(
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Delivers batch.completed/failed/expired/cancelled events to BATCH_WEBHOOK_URLS and to the batch "
    "owner's webhook endpoints (/v1/webhook_endpoints), signed per Standard Webhooks; failed attempts are retried "
    "with exponential backoff, then given up.",
)
@timed
def webhook_sensor(
    context: dg.SensorEvaluationContext, database: DatabaseResource, webhooks: WebhookConfig
) -> dg.SkipReason:
    if webhooks.urls and (problem := check_secret(webhooks.secret)):
        return dg.SkipReason(f"Webhooks are not sent: {problem}")
    with database.session() as session:
        attempts = deliver_due(session, webhooks.urls, webhooks.sender(), max_attempts=webhooks.max_attempts,
                               first_backoff_s=webhooks.first_backoff_s)
    if not attempts:
        return dg.SkipReason("No webhook to deliver.")
    for a in attempts:
        delivery = a.delivery
        # The host only: a webhook URL may carry its secret in its path or query (Slack's do).
        host = urlsplit(delivery.url).hostname or "?"
        target = f"endpoint {delivery.endpoint_id} ({host})" if delivery.endpoint_id else host
        if a.error is None:
            context.log.info(f"{a.event.type} {a.event.batch_id} -> {target}: delivered (attempt {delivery.attempts})")
        else:
            context.log.warning(f"{a.event.type} {a.event.batch_id} -> {target}: attempt {delivery.attempts} "
                                f"failed ({a.error}){'; giving up' if delivery.failed_at is not None else ''}")
    sent = sum(a.error is None for a in attempts)
    return dg.SkipReason(f"{sent} webhook(s) delivered, {len(attempts) - sent} attempt(s) failed.")
