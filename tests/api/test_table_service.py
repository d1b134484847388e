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
    on_service = {"service_url": f"{service.url}/v1", "service_api_key": KEY_A}
    unserved = {**component_yaml()["attributes"]["request"], "model": "not-a-served-model"}
    with table_project(component_yaml(**on_service),
                       component_yaml(**on_service, asset={"key": "refused"}, request=unserved)) as (defs, tables):
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

        # A batch the service refuses fails the step, its errors named by row and field.
        result = materialize(defs, ["reviews", "refused"], res, instance, raise_on_error=False)
        failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
        message = failure.step_failure_data.error.message
        assert "row 0: [model_not_found]" in message and "(field: body.model)" in message


def test_a_terminated_run_cancels_its_batch_on_the_service(start_service, tmp_path, monkeypatch):
    from batch_dagster.client import BatchService

    service = start_service(engine=LabelEngine(), worker=False)  # the batch stays queued: nothing runs it
    instance = service.instance

    def terminated(self, batch_id, on_poll=None):
        """What the step sees when the UI terminates its run: the run CANCELING, then the interrupt."""
        [run] = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
        instance.report_run_canceling(run)
        raise KeyboardInterrupt

    monkeypatch.setattr(BatchService, "wait", terminated)
    with table_project(component_yaml(service_url=f"{service.url}/v1", service_api_key=KEY_A)) as (defs, tables):
        tables["reviews"] = reviews_frame()
        result = materialize(defs, ["reviews", "review_labels"], table_resources(tmp_path, LabelEngine(), "y"),
                             instance, raise_on_error=False)
    assert not result.success
    assert not [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]  # not rerun
    [batch] = service.client().batches.list().data
    assert batch.status in ("cancelling", "cancelled")
