"""Webhooks: each batch that ended is POSTed, signed, to every global endpoint and to its owner's subscribed
endpoints; failed attempts are retried with backoff."""

from __future__ import annotations

import dagster as dg

from batch_dagster.db import webhooks as outbox
from batch_dagster.defs.resources import DatabaseResource
from batch_dagster.defs.resources.webhooks import WebhookConfig, check_secret, event_body
from batch_dagster.defs.sensors.timing import timed


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
        # With no endpoint configured, events are planned with no delivery: turning webhooks on later
        # (or adding an endpoint) does not flood the endpoints with old events.
        outbox.plan(session, webhooks.urls)
        work = outbox.due(session)
        if not work:
            return dg.SkipReason("No webhook to deliver.")
        data = outbox.event_data(session, [e for _, e, _ in work])
        posts = [(d.url, secret, e.id, event_body(e.id, e.type, e.created_at, data[e.id])) for d, e, secret in work]
        errors = webhooks.send_all(posts)
        for (delivery, event, _), error in zip(work, errors, strict=True):
            outbox.record(session, delivery, error, max_attempts=webhooks.max_attempts,
                          first_backoff_s=webhooks.first_backoff_s)
            if error is not None:
                gave_up = delivery.failed_at is not None
                target = f"endpoint {delivery.endpoint_id} ({delivery.url})" if delivery.endpoint_id else delivery.url
                context.log.warning(f"{event.type} {event.batch_id} -> {target}: attempt {delivery.attempts} "
                                    f"failed ({error}){'; giving up' if gave_up else ''}")
        session.commit()
    sent = sum(error is None for error in errors)
    return dg.SkipReason(f"{sent} webhook(s) delivered, {len(errors) - sent} attempt(s) failed.")
