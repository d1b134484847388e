"""The service's Prometheus metrics: the API's requests and latency by route (prometheus-fastapi-instrumentator), and
the service's state read from the store at each scrape (db/metrics.py), by key name and model.

They name every key and what it runs, so they are the operator's: served on a listener of their own (`serve`,
prometheus_client's exporter, on BATCH_METRICS_HOST:BATCH_METRICS_PORT, loopback by default), never on the API's
tenant-facing one. A model label is one of the registry's, or `other`: a client's model string never becomes a label.

The state is read, not counted in this process: batches and requests by key and model, tokens, the queue, the ETA's
error, webhook deliveries, the sensors' ticks (which the sensors record in the store) and the warm fleets. So a
restart of the API resets none of these counters, and any number of API processes answer alike. A store that does
not answer is `batch_dagster_store_up 0`, never a failed scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator

from batch_dagster.batchfile.registry import load_registry
from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.db import keys
from batch_dagster.db import metrics as stored
from batch_dagster.db.models import FLEET_STATES

from .context import AppContext

log = logging.getLogger("batch_dagster.api.metrics")
PATH = "/metrics"
NAMESPACE = "batch_dagster"
# Seconds: from a metadata read (a few ms) to an upload of a large file.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def install(app: FastAPI, context: AppContext) -> None:
    """Count the app's requests by route into a registry of this app's own (`app.state.metrics`), which `serve`
    exposes; the app itself serves no /metrics."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(context, _registry_models(context)))
    instrumentator = Instrumentator(registry=registry)
    instrumentator.instrument(app, metric_namespace=NAMESPACE, latency_lowr_buckets=LATENCY_BUCKETS)
    app.state.metrics = registry


@dataclass
class Listener:
    """The metrics' own listener: where it is, and how to stop it."""

    host: str
    port: int
    server: WSGIServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{PATH}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve(app: FastAPI, host: str, port: int) -> Listener:
    """Serve `app`'s metrics (install) on `host`:`port` (0: a free port), off the API's own listener:
    prometheus_client's exporter, in a thread of its own. OSError when the port is taken."""
    server, thread = start_http_server(port, addr=host, registry=app.state.metrics)
    listener = Listener(host, server.server_port, server, thread)
    log.info("metrics on %s (the operator's: keep this port off any tenant-facing ingress)", listener.url)
    return listener


def _registry_models(context: AppContext) -> frozenset[str]:
    """The models a model label may name: the registry's (read once, at start)."""
    try:
        return frozenset(load_registry(context.config.models_file))
    except (OSError, ValueError) as exc:  # the API still serves; every batch's model is `other`
        log.warning("metrics: the model registry %s could not be read (%r): every model is labelled `%s`",
                    context.config.models_file, exc, stored.OTHER)
        return frozenset()


def _name(metric: str) -> str:
    return f"{NAMESPACE}_{metric}"


class StoreCollector(Collector):
    """The service's state as Prometheus metrics, from a few grouped queries on the store at each scrape."""

    def __init__(self, context: AppContext, models: frozenset[str]):
        self.context, self.models = context, models

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily(_name("store_up"), "1 when the store answered this scrape's queries, else 0.")
        try:
            families = list(self._families(time.time()))
        except Exception as exc:  # the store restarting or unreachable: the rest of /metrics still answers
            log.warning("metrics: the store did not answer: %r", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families
        took = GaugeMetricFamily(_name("store_scrape_seconds"), "How long this scrape's store queries took.")
        took.add_metric([], time.perf_counter() - started)
        yield took

    def _families(self, now: float) -> Iterator[Metric]:
        with self.context.db.session() as session:
            names = keys.labels(session)
            groups = stored.batch_groups(session, self.models)
            oldest = stored.oldest_queued(session, self.models)
            eta = stored.eta_errors(session, self.models)
            deliveries = stored.webhook_deliveries(session)
            ticks = stored.sensor_ticks(session)
            fleets = stored.fleets(session)

        def key(owner: str) -> str:
            return names.get(owner, keys.UNNAMED)

        yield from _batches(groups, key)
        age = GaugeMetricFamily(_name("queue_oldest_age_seconds"), "Age of the oldest batch of a model still "
                                "waiting for its run to start (validating).", labels=["model"])
        for model, created in oldest.items():
            age.add_metric([model], max(now - created, 0))
        yield age
        error = HistogramMetricFamily(_name("eta_relative_error"), "The error of the first estimated end each "
                                      "completed batch was given: |estimated end - end| over the batch's whole time "
                                      "(created to completed).", labels=["model"])
        for e in eta:
            buckets = [(str(bound), n) for bound, n in zip(stored.ETA_ERROR_BUCKETS, e.buckets, strict=True)]
            error.add_metric([e.model], [*buckets, ("+Inf", e.count)], e.total)
        yield error
        yield from _deliveries(deliveries, key)
        yield from _ticks(ticks)
        yield from _fleets(fleets)


def _batches(groups: list[stored.BatchGroup], key) -> Iterator[Metric]:
    batches = GaugeMetricFamily(_name("batches"), "Batches by key, model and status.",
                                labels=["key", "model", "status"])
    queued = GaugeMetricFamily(_name("queue_depth"), "Batches waiting for their run to start (validating), by key "
                               "and model.", labels=["key", "model"])
    unfinished = GaugeMetricFamily(_name("unfinished_batches"), "Batches not ended (waiting, running, finalizing or "
                                   "cancelling), by model: what a model's replicas follow.", labels=["model"])
    requests = CounterMetricFamily(_name("requests"), "Requests finished, by outcome: `completed` (a line of the "
                                   "output file) or `failed` (a line of the error file).",
                                   labels=["key", "model", "outcome"])
    tokens = CounterMetricFamily(_name("tokens"), "Tokens processed: `input` (prompt) and `output` (generated).",
                                 labels=["key", "model", "kind"])
    per_key: dict[tuple[str, str], list[int]] = {}
    per_model: dict[str, int] = {}
    for g in groups:
        labels = (key(g.owner), g.model)
        batches.add_metric([*labels, g.status], g.batches)
        sums = per_key.setdefault(labels, [0, 0, 0, 0, 0])
        for i, n in enumerate((g.completed, g.failed, g.input_tokens, g.output_tokens)):
            sums[i] += n
        if g.status == BatchStatus.VALIDATING:
            sums[4] += g.batches
        if g.status not in TERMINAL:
            per_model[g.model] = per_model.get(g.model, 0) + g.batches
    for labels, (completed, failed, input_tokens, output_tokens, waiting) in per_key.items():
        requests.add_metric([*labels, "completed"], completed)
        requests.add_metric([*labels, "failed"], failed)
        tokens.add_metric([*labels, "input"], input_tokens)
        tokens.add_metric([*labels, "output"], output_tokens)
        queued.add_metric(list(labels), waiting)
    for model, n in per_model.items():
        unfinished.add_metric([model], n)
    yield from (batches, queued, unfinished, requests, tokens)


def _deliveries(deliveries: list[stored.Deliveries], key) -> Iterator[Metric]:
    state = GaugeMetricFamily(_name("webhook_deliveries"), "Webhook deliveries by key and state: `delivered`, "
                              "`given_up` (every attempt failed) or `pending`.", labels=["key", "state"])
    failed = CounterMetricFamily(_name("webhook_failed_attempts"), "Webhook delivery attempts that failed (the "
                                 "endpoint unreachable, or an answer other than 2xx).", labels=["key"])
    for d in deliveries:
        for name, n in (("delivered", d.delivered), ("given_up", d.given_up), ("pending", d.pending)):
            state.add_metric([key(d.owner), name], n)
        failed.add_metric([key(d.owner)], d.failed_attempts)
    yield from (state, failed)


def _ticks(ticks: list[stored.Ticks]) -> Iterator[Metric]:
    seconds = SummaryMetricFamily(_name("sensor_tick_seconds"), "Seconds the daemon's sensors took per "
                                  "evaluation (count: evaluations).", labels=["sensor"])
    last = GaugeMetricFamily(_name("sensor_last_tick_seconds"), "Seconds the sensor's last evaluation took.",
                             labels=["sensor"])
    at = GaugeMetricFamily(_name("sensor_last_tick_timestamp_seconds"), "When the sensor's last evaluation ended "
                           "(unix seconds).", labels=["sensor"])
    failures = CounterMetricFamily(_name("sensor_tick_failures"), "Sensor evaluations that raised.",
                                   labels=["sensor"])
    for t in ticks:
        seconds.add_metric([t.name], t.ticks, t.seconds_total)
        last.add_metric([t.name], t.last_seconds)
        at.add_metric([t.name], t.last_at)
        failures.add_metric([t.name], t.failures)
    yield from (seconds, last, at, failures)


def _fleets(fleets: list[stored.Fleet]) -> Iterator[Metric]:
    state = GaugeMetricFamily(_name("fleet_state"), "1 for the state each warm fleet of `make serve` is in "
                              f"({', '.join(FLEET_STATES)}), 0 for the others.", labels=["model", "state"])
    start = GaugeMetricFamily(_name("fleet_start_seconds"), "How long the fleet's replicas took to answer on their "
                              "last start.", labels=["model"])
    for f in fleets:
        for name in FLEET_STATES:
            state.add_metric([f.model, name], 1 if f.state == name else 0)
        if f.start_s is not None:
            start.add_metric([f.model], f.start_s)
    yield from (state, start)
