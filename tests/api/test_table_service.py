"""A table batch run by a batch-dagster service (its URL and key in the component's YAML): the rows go up as a
batch file through the API, the answers come back into the table, and a retried step follows the batch it made."""

from __future__ import annotations

import dagster as dg

from batch_dagster.client import TABLE_BATCH_KEY
from tests.helpers import (
    KEY_A,
    LabelEngine,
    component_yaml,
    labels_of,
    materialize,
    reviews_frame,
    table_project,
    table_resources,
)


def test_a_table_batch_runs_on_a_service_and_a_retry_follows_its_batch(start_service, tmp_path):
    engine = LabelEngine()
    service = start_service(engine=engine, shard_size=3)
    instance = service.instance  # one instance: the worker's (a second one, opened apart, would close out of order)
    local = tmp_path / "project-data"  # the project's own storage: its IO manager's tables, nothing of the batch
    with table_project(component_yaml(service_url=f"{service.url}/v1", service_api_key=KEY_A)) as (defs, tables):
        tables["reviews"] = reviews_frame()
        assert defs.resolve_assets_def("review_labels").op.pool is None  # no engine in the run: no pool to wait in
        res = table_resources(local, LabelEngine(), "service-side-unused")
        labels, meta = labels_of(materialize(defs, ["reviews", "review_labels"], res, instance))
        assert labels["sentiment"].tolist()[:2] == ["positive", "negative"] and labels["error"].isna().all()
        assert meta["rows"] == 8 and meta["computed"] == 8 and meta["service_status"] == "completed"
        assert len(engine.ran) == 8  # the service's engine ran them, in its shards of 3
        batch = service.client().batches.retrieve(meta["service_batch"])
        assert batch.metadata[TABLE_BATCH_KEY].startswith("table_") and batch.request_counts.completed == 8

        # The same rows again (a retried step, or a re-run): the batch it created is followed, not made again.
        again = materialize(defs, ["reviews", "review_labels"], res, instance)
        assert labels_of(again)[1]["service_batch"] == meta["service_batch"] and len(engine.ran) == 8
        assert len(service.client().batches.list().data) == 1
        assert not (local / "batches").exists()


def test_a_batch_the_service_refuses_fails_the_step_naming_the_rows(start_service, tmp_path):
    service = start_service(engine=LabelEngine())
    instance = service.instance
    request = {**component_yaml()["attributes"]["request"], "model": "not-a-served-model"}
    with table_project(component_yaml(service_url=f"{service.url}/v1", service_api_key=KEY_A,
                                      request=request)) as (defs, tables):
        tables["reviews"] = reviews_frame()
        result = materialize(defs, ["reviews", "review_labels"], table_resources(tmp_path, LabelEngine(), "x"),
                             instance, raise_on_error=False)
        failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
        message = failure.step_failure_data.error.message
        assert "row 0: [model_not_found]" in message and "(field: body.model)" in message


def test_an_interrupted_step_cancels_its_batch_on_the_service(start_service, tmp_path, monkeypatch):
    from batch_dagster.client import BatchService

    service = start_service(engine=LabelEngine(), worker=False)  # the batch stays queued: nothing runs it
    instance = service.instance

    def interrupted(self, batch_id, on_poll=None):
        raise KeyboardInterrupt  # what the step sees when its run is terminated

    monkeypatch.setattr(BatchService, "wait", interrupted)
    with table_project(component_yaml(service_url=f"{service.url}/v1", service_api_key=KEY_A)) as (defs, tables):
        tables["reviews"] = reviews_frame()
        result = materialize(defs, ["reviews", "review_labels"], table_resources(tmp_path, LabelEngine(), "y"),
                             instance, raise_on_error=False)
    assert not result.success
    [batch] = service.client().batches.list().data
    assert batch.status in ("cancelling", "cancelled")
