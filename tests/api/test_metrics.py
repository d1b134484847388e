"""/metrics (issue 31): the API's requests by route (the route's template, never a client's id) and the service's
state read from the store at scrape time, by key name and model; a store that does not answer is
`batch_dagster_store_up 0` in a scrape that still succeeds. They are the operator's (issue 45): served on a listener
of their own, never on the API's, and a model label is the registry's or `other`, whatever model a client names."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from batch_dagster.api import metrics
from batch_dagster.db import Database
from batch_dagster.db.metrics import record_tick
from batch_dagster.db.models import BatchRecord
from tests.helpers import CHAT_MODEL, KEY_A, KEY_B, rows, upload, wait_for

CHAT = "/v1/chat/completions"


def scrape(service) -> dict[str, dict[tuple, float]]:
    """Every sample of /metrics (on the metrics' own listener): name -> {sorted labels: value}."""
    answer = httpx.get(service.metrics_url, timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def labels(**pairs: str) -> tuple:
    return tuple(sorted(pairs.items()))


def test_metrics_show_batches_requests_and_tokens_by_key_and_model(start_service, tmp_path):
    service = start_service(api_keys=(f"alice:{KEY_A}", f"bob:{KEY_B}"))
    a, b = service.client(KEY_A), service.client(KEY_B)
    done = wait_for(a, a.batches.create(input_file_id=upload(a, tmp_path / "a.jsonl", rows(3)), endpoint=CHAT,
                                        completion_window="24h").id, "completed")
    service.worker.stopping.set()
    service.worker.join(30)
    queued = b.batches.create(input_file_id=upload(b, tmp_path / "b.jsonl", rows(2)), endpoint=CHAT,
                              completion_window="24h")  # no worker now: it waits
    a.files.retrieve(done.output_file_id)
    with Database(service.config.database_url).session() as session:
        record_tick(session, "a_sensor", 0.25, ok=True)
        record_tick(session, "a_sensor", 0.75, ok=False)

    m = scrape(service)
    assert m["batch_dagster_store_up"][()] == 1
    assert m["batch_dagster_batches"][labels(key="alice", model=CHAT_MODEL, status="completed")] == 1
    assert m["batch_dagster_batches"][labels(key="bob", model=CHAT_MODEL, status="validating")] == 1
    assert m["batch_dagster_requests_total"][labels(key="alice", model=CHAT_MODEL, outcome="completed")] == 3
    assert m["batch_dagster_requests_total"][labels(key="alice", model=CHAT_MODEL, outcome="failed")] == 0
    usage = done.usage
    assert m["batch_dagster_tokens_total"][labels(key="alice", model=CHAT_MODEL, kind="input")] == usage.input_tokens
    assert m["batch_dagster_tokens_total"][labels(key="alice", model=CHAT_MODEL, kind="output")] == usage.output_tokens
    assert m["batch_dagster_queue_depth"][labels(key="bob", model=CHAT_MODEL)] == 1
    assert m["batch_dagster_unfinished_batches"][labels(model=CHAT_MODEL)] == 1
    assert m["batch_dagster_queue_oldest_age_seconds"][labels(model=CHAT_MODEL)] >= 0
    assert m["batch_dagster_sensor_tick_seconds_count"][labels(sensor="a_sensor")] == 2
    assert m["batch_dagster_sensor_tick_seconds_sum"][labels(sensor="a_sensor")] == 1.0
    assert m["batch_dagster_sensor_tick_failures_total"][labels(sensor="a_sensor")] == 1
    assert m["batch_dagster_sensor_tick_seconds_count"][labels(sensor="api_batch_sensor")] >= 1  # the worker's ticks
    # The ETA's error of the completed batch, against the first end it was given.
    with Database(service.config.database_url).session() as session:
        row = session.query(BatchRecord).filter_by(id=done.id).one()
        row.created_at = row.completed_at - 100
        row.first_estimated_completion_at = row.completed_at + 30  # off by 30% of the 100 s it took
        session.commit()
    m = scrape(service)
    assert m["batch_dagster_eta_relative_error_count"][labels(model=CHAT_MODEL)] == 1
    buckets = {dict(k)["le"]: v for k, v in m["batch_dagster_eta_relative_error_bucket"].items()}
    assert (buckets["0.25"], buckets["0.5"], buckets["+Inf"]) == (0, 1, 1)
    # HTTP requests by route template: the ids in the paths are not labels.
    handlers = {dict(k)["handler"] for k in m["batch_dagster_http_requests_total"]}
    assert "/v1/files/{file_id}" in handlers and not any(queued.id in h or done.output_file_id in h for h in handlers)
    assert any(dict(k)["handler"] == "/v1/batches" for k in m["batch_dagster_http_request_duration_seconds_bucket"])
    assert "/metrics" not in handlers


def test_a_scrape_while_the_store_is_away_says_so_and_still_succeeds(start_service, monkeypatch):
    service = start_service(worker=False)
    service.http(KEY_A).get("/v1/files")

    def away(self, now):
        raise ConnectionError("the store is restarting")

    monkeypatch.setattr(metrics.StoreCollector, "_families", away)
    m = scrape(service)
    assert m["batch_dagster_store_up"][()] == 0
    assert "batch_dagster_batches" not in m
    assert any(dict(k)["handler"] == "/v1/files" for k in m["batch_dagster_http_requests_total"])
    assert service.http(KEY_A).get("/v1/files").status_code == 200  # the API is up


def test_the_apis_own_listener_serves_no_metrics_with_a_key_or_without(start_service):
    """A tenant reaches the API's listener only: /metrics there is a 404 (before, it named every key, its models,
    counts and tokens to anyone, no key needed)."""
    service = start_service(worker=False, api_keys=(f"alice:{KEY_A}", f"bob:{KEY_B}"))
    for key in (None, KEY_A):
        answer = service.http(key).get("/metrics")
        assert answer.status_code == 404 and "alice" not in answer.text and "batch_dagster_" not in answer.text
    assert "batch_dagster_store_up 1.0" in httpx.get(service.metrics_url, timeout=30).text  # the operator's has them
    assert service.metrics_url.startswith("http://127.0.0.1:")


def test_a_clients_model_names_never_become_labels(start_service, tmp_path):
    """2,000 batches of invented model names (a batch's model is its file's first line, any string): their series
    fold into one `other`, beside the registry's models, and the scrape reads a row per key, label and status."""
    service = start_service(worker=False)
    a = service.client(KEY_A)
    a.batches.create(input_file_id=upload(a, tmp_path / "a.jsonl", rows(2)), endpoint=CHAT, completion_window="24h")
    invented = upload(a, tmp_path / "x.jsonl", rows(2, model="invented-0"))
    made = a.batches.create(input_file_id=invented, endpoint=CHAT, completion_window="24h")
    with Database(service.config.database_url).session() as session:
        template = session.query(BatchRecord).filter_by(id=made.id).one()
        session.add_all(BatchRecord(**{c.name: getattr(template, c.name) for c in BatchRecord.__table__.columns
                                       if c.name != "pk"} | {"id": f"batch_x{i}", "model": f"invented-{i}"})
                        for i in range(1, 2000))
        session.commit()
    m = scrape(service)
    models = {dict(k)["model"] for name, samples in m.items() for k in samples if "model" in dict(k)}
    assert models == {CHAT_MODEL, "other"}, sorted(models)[:10]
    assert m["batch_dagster_batches"][labels(key=key_name(service, KEY_A), model="other", status="validating")] == 2000
    assert m["batch_dagster_queue_depth"][labels(key=key_name(service, KEY_A), model="other")] == 2000
    assert m["batch_dagster_unfinished_batches"][labels(model="other")] == 2000


def key_name(service, key: str) -> str:
    from batch_dagster.db import keys, repo

    with Database(service.config.database_url).session() as session:
        return keys.labels(session)[repo.owner_of_key(key)]
