"""The table batch component in a project of its own, on a fake engine: YAML to asset, partitions that follow the
upstream, typed answers, reuse, retries, the cost cap, and bad input named by row and field."""

from __future__ import annotations

import json
import re
import textwrap

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.defs.resources import PipelineConfig, StorageResource
from batch_dagster.defs.table.component import IO_MANAGER, PIPELINE, STORAGE, VLLM
from batch_dagster.defs.table.io_manager import TableIOManager, as_pandas
from batch_dagster.engine.models import Models
from batch_dagster.features.reuse import AnswerStore
from tests.helpers import (
    LabelEngine,
    component_yaml,
    count_words,
    fake_vllm,
    label_body,
    labels_of,
    materialize,
    reviews_frame,
    table_project,
    table_resources,
)


@pytest.fixture(autouse=True)
def word_tokens(monkeypatch):
    """The estimate's tokens counted one per word, in a 2,048-token context: no real tokenizer, no model prepared."""
    count_words(monkeypatch)


def test_a_table_is_answered_into_typed_columns_and_reused_when_rows_come_back(tmp_path, data_dir, instance):
    engine = LabelEngine()
    with table_project(component_yaml()) as (defs, tables):
        spec = defs.resolve_assets_def("review_labels")
        assert spec.partitions_def is None and spec.keys_by_input_name["upstream"] == dg.AssetKey("reviews")
        assert spec.op.pool == "batch_engine"  # the model loads in its run: a project bounds such runs by this pool
        tables["reviews"] = reviews_frame()
        res = table_resources(data_dir, engine, "labels")
        first = materialize(defs, ["reviews", "review_labels"], res, instance)
        labels, meta = labels_of(first)
        assert list(labels.columns) == ["row", "review_id", "answer", "sentiment", "confidence", "topic",
                                        "finish_reason", "prompt_tokens", "completion_tokens", "reused",
                                        "error_code", "error"]
        assert labels["sentiment"].tolist() == ["positive", "negative", "positive", "negative", "positive",
                                                "negative", "negative", "positive"]
        assert labels["confidence"].dtype == "Float64" and labels["confidence"].tolist()[0] == 1.0
        assert labels["review_id"].tolist() == reviews_frame()["review_id"].tolist() and labels["error"].isna().all()
        assert (meta["rows"], meta["computed"], meta["reused"], meta["failed"]) == (8, 8, 0, 0)
        assert meta["completion_tokens"] == 8 * 12 and meta["cost"] > 0 and meta["wall_s"] > 0
        check = first.get_asset_check_evaluations()[0]
        assert check.check_name == "every_row_answered_once" and check.passed
        assert engine.prompts[0] == "Review (5 stars): review number 0 about the kettle"

        # Two rows change: only they run again; the rest come from the answer store, billed at zero.
        changed = reviews_frame().copy()
        changed.loc[[2, 5], "text"] = ["a new text for row two", "a new text for row five"]
        tables["reviews"] = changed
        engine.ran.clear()
        second = materialize(defs, ["reviews", "review_labels"], res, instance)
        labels, meta = labels_of(second)
        assert sorted(engine.ran) == ["row-2", "row-5"]
        assert (meta["computed"], meta["reused"], meta["completion_tokens"]) == (2, 6, 2 * 12)
        assert labels["reused"].tolist() == [True, True, False, True, True, False, True, True]
        # The answers are those of the first run, the batch folder is gone, the table is Parquet in the storage.
        assert labels["sentiment"].tolist()[0] == "positive"
        assert not (data_dir / "batches").exists() or not any((data_dir / "batches").iterdir())
        assert pd.read_parquet(data_dir / "tables" / "review_labels" / "table.parquet")["reused"].sum() == 6


def test_partitions_follow_a_daily_upstream_one_batch_per_partition(tmp_path, data_dir, instance):
    engine = LabelEngine()
    with table_project(component_yaml(asset={"key": "ticket_labels"}, upstream="tickets")) as (defs, tables):
        labels = defs.resolve_assets_def("ticket_labels")
        assert isinstance(labels.partitions_def, dg.DailyPartitionsDefinition)
        assert labels.partitions_def == defs.resolve_assets_def("tickets").partitions_def
        assert labels.backfill_policy == dg.BackfillPolicy.multi_run(1)  # a backfill: one batch per partition
        tables["2026-11-03"] = reviews_frame().head(2)
        tables["2026-11-04"] = reviews_frame().tail(3)
        res = table_resources(data_dir, engine, "daily")
        for day, rows in (("2026-11-03", 2), ("2026-11-04", 3)):
            result = materialize(defs, ["tickets", "ticket_labels"], res, instance, partition=day)
            table, meta = labels_of(result, "ticket_labels")
            assert len(table) == rows and meta["rows"] == rows
        assert (data_dir / "tables" / "ticket_labels" / "2026-11-04.parquet").exists()
        # A downstream asset reads a partition back through the IO manager, as pyarrow when it asks for it.
        io = TableIOManager(data_dir=str(data_dir))
        with dg.build_input_context(asset_key=dg.AssetKey("ticket_labels"), partition_key="2026-11-03",
                                    asset_partitions_def=labels.partitions_def, instance=instance,
                                    dagster_type=dg.DagsterType(lambda _, __: True, typing_type=pa.Table,
                                                                name="t")) as context:
            assert io.load_input(context).column("review_id").to_pylist() == ["r0", "r1"]


def test_partitions_follow_an_upstream_that_another_component_defines(tmp_path):
    """A table batch over another one's answered table: its partitions are found in that component's assets (the
    downstream's folder comes first, so the upstream's is built on demand)."""
    summaries = component_yaml(asset={"key": "ticket_summaries"}, upstream="ticket_labels")
    with table_project(summaries, component_yaml(asset={"key": "ticket_labels"}, upstream="tickets")) as (defs, _):
        assert isinstance(defs.resolve_assets_def("ticket_summaries").partitions_def, dg.DailyPartitionsDefinition)
        assert defs.resolve_assets_def("ticket_summaries").partitions_def == \
            defs.resolve_assets_def("tickets").partitions_def


def test_bad_rows_are_named_by_row_and_field_and_the_rest_are_answered(tmp_path, data_dir, instance):
    engine = LabelEngine()
    with table_project(component_yaml(request={**component_yaml()["attributes"]["request"],
                                         "params": {"temperature": 0, "max_tokens": 40}})) as (defs, tables):
        rows = reviews_frame().copy().astype({"text": object})
        rows.loc[1, "text"] = None  # an empty cell the template names
        rows.loc[3, "text"] = "x" * 3000  # a request longer than a line may be
        rows.loc[6, "text"] = "cut me"  # its structured output is cut at max_tokens
        tables["reviews"] = rows
        res = table_resources(data_dir, engine, "bad-rows", max_line_bytes=2000)
        labels, meta = labels_of(materialize(defs, ["reviews", "review_labels"], res, instance))
        errors = dict(zip(labels["row"], labels["error_code"], strict=True))
        assert {k: v for k, v in errors.items() if pd.notna(v)} == {1: "empty_value", 3: c.LINE_TOO_LARGE,
                                                                      6: "structured_output_cut"}
        assert labels.loc[1, "error"] == "Column 'text' is empty in this row. (field: user)"
        assert "(field: system, user)" in labels.loc[3, "error"] and "(field: max_tokens)" in labels.loc[6, "error"]
        assert labels.loc[6, "finish_reason"] == "length"
        assert (meta["answered"], meta["failed"], meta["cut"], meta["computed"]) == (5, 3, 1, 6)
        assert sorted(engine.ran) == [f"row-{i}" for i in (0, 2, 4, 5, 6, 7)]
        assert "| 1 | {'review_id': 'r1'} | empty_value | user | Column 'text' is empty in this row. |" in \
            meta["errors"]


FLAGS = {"type": "object", "properties": {"flagged": {"type": "boolean"}, "stars": {"type": "integer"},
                                          "confidence": {"type": "number"}, "sentiment": {"type": "string"}},
         "required": ["flagged", "stars", "confidence", "sentiment"]}


class FlagEngine:
    """Answers FLAGS from the review's stars: flagged below 3."""

    def run(self, endpoint: str, requests, on_progress=None) -> list[dict]:
        lines = []
        for cid, body in requests:
            stars = int(re.search(r"(\d) stars", body["messages"][-1]["content"]).group(1))
            text = json.dumps({"flagged": stars < 3, "stars": stars, "confidence": stars / 5, "sentiment": "fine"})
            lines.append(c.success_line(cid, label_body(body["model"], text, "stop")))
            if on_progress is not None:
                on_progress(1)
        return lines


def test_a_failed_rows_missing_values_keep_the_columns_types_through_parquet(tmp_path, data_dir, instance):
    request = {**component_yaml()["attributes"]["request"], "json_schema": FLAGS}
    with table_project(component_yaml(request=request)) as (defs, tables):
        rows = reviews_frame().copy().astype({"text": object})
        rows.loc[1, "text"] = None  # this row fails: no answer, no token counts
        tables["reviews"] = rows
        labels, meta = labels_of(materialize(defs, ["reviews", "review_labels"], table_resources(
            data_dir, FlagEngine(), "flags"), instance))
    assert (meta["answered"], meta["failed"]) == (7, 1)
    # pandas' nullable types: NumPy's bool and int64 hold no missing value (object and float64 before).
    nullable = {"row": "Int64", "review_id": "string", "answer": "string", "flagged": "boolean", "stars": "Int64",
                "confidence": "Float64", "sentiment": "string", "finish_reason": "string",
                "prompt_tokens": "Int64", "completion_tokens": "Int64", "reused": "boolean",
                "error_code": "string", "error": "string"}
    assert labels.dtypes.astype(str).to_dict() == nullable
    assert labels["flagged"].tolist() == [False, pd.NA, False, True, False, True, False, False]
    assert labels["stars"].tolist() == [5, pd.NA, 4, 2, 5, 1, 3, 4]
    assert labels.loc[1, "prompt_tokens"] is pd.NA and labels.loc[0, "prompt_tokens"] == 30
    assert labels.loc[1, "error_code"] == "empty_value" and labels.loc[0, "error_code"] is pd.NA
    # Parquet keeps them: read back as a downstream asset reads it, and by pandas itself.
    path = data_dir / "tables" / "review_labels" / "table.parquet"
    with dg.build_input_context(asset_key=dg.AssetKey("review_labels"), instance=instance,
                                dagster_type=dg.DagsterType(lambda _, __: True, name="frame")) as context:
        again = TableIOManager(data_dir=str(data_dir)).load_input(context)
    pd.testing.assert_frame_equal(again, labels)
    assert pd.read_parquet(path).dtypes.astype(str).to_dict() == nullable
    # A table written from pyarrow (no pandas dtypes recorded) reads back nullable as well.
    arrow = pq.read_table(path).replace_schema_metadata(None)
    assert as_pandas(arrow).dtypes.astype(str).to_dict() == nullable


def test_a_template_naming_a_missing_column_fails_before_anything_runs(tmp_path, data_dir, instance):
    engine = LabelEngine()
    request = {**component_yaml()["attributes"]["request"], "user": "Review of {product}: {text}"}
    with table_project(component_yaml(request=request)) as (defs, tables):
        tables["reviews"] = reviews_frame()
        result = materialize(defs, ["reviews", "review_labels"], table_resources(data_dir, engine, "missing"), instance,
                             raise_on_error=False)
        failure = next(e for e in result.all_events if e.is_step_failure)
        message = failure.step_failure_data.error.message
        assert "'product'" in message and "request.user" in message and "review_id, stars, text" in message
        assert engine.ran == []


@pytest.mark.parametrize(("request_fields", "says"), [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "strng"}}}},
     "request.json_schema.properties.a.type: not valid JSON Schema"),
    ({"user": "{text.upper}"}, "request.user: {text.upper} is not a column name"),
    ({"params": {"temperature": "hot"}}, "request.params.temperature"),
])
def test_a_request_no_row_could_run_fails_at_load_naming_its_field(request_fields, says):
    request = {**component_yaml()["attributes"]["request"], **request_fields}
    with pytest.raises(Exception) as caught, table_project(component_yaml(request=request)):
        pass
    assert says in "".join(str(e) for e in _chain(caught.value))


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def test_an_engine_crash_retries_the_step_and_committed_shards_are_not_run_again(tmp_path, data_dir, instance):
    engine = LabelEngine(crash_times=1)
    with table_project(component_yaml(reuse=False)) as (defs, tables):
        tables["reviews"] = reviews_frame()
        result = materialize(defs, ["reviews", "review_labels"], table_resources(data_dir, engine, "crash"), instance)
        labels, meta = labels_of(result)
        assert meta["answered"] == 8 and len(engine.ran) == 8  # the crashed shard ran once, after the retry
        retries = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
        assert len(retries) == 1


class DiesAfterOneShard(LabelEngine):
    """Answers one shard, then fails as a broken host does (not an engine crash: the step fails for good)."""

    def run(self, endpoint, requests, on_progress=None):
        if self.ran:
            raise RuntimeError("the engine's host went away")
        return super().run(endpoint, requests, on_progress)


def test_a_folder_a_failed_run_left_is_discarded_once_the_rows_change(tmp_path, data_dir, instance, monkeypatch):
    monkeypatch.setenv("BATCH_STEP_RETRY_DELAY_S", "0")  # read when the component builds its asset
    with table_project(component_yaml()) as (defs, tables):
        tables["reviews"] = reviews_frame()
        failed = materialize(defs, ["reviews", "review_labels"], table_resources(data_dir, DiesAfterOneShard(), "dies"),
                             instance, raise_on_error=False)
        assert not failed.success and len(list((data_dir / "batches").iterdir())) == 1  # its 1 committed shard
        edited = reviews_frame()
        edited.loc[7, "text"] = "an edited review of the kettle"  # in the last shard
        tables["reviews"] = edited
        engine = LabelEngine()
        labels, meta = labels_of(materialize(defs, ["reviews", "review_labels"],
                                             table_resources(data_dir, engine, "after"), instance))
    # The left folder's shard was not taken as it was (other rows), its kept answers were: nothing computed twice.
    assert (meta["answered"], meta["reused"], len(engine.ran)) == (8, 3, 5)
    assert list((data_dir / "batches").iterdir()) == []  # the left folder discarded, the new one removed when done
    assert labels.loc[7, "review_id"] == "r7" and labels.loc[7, "sentiment"] == "positive"


def test_the_cost_cap_stops_the_batch_and_every_row_still_has_an_answer_or_an_error(tmp_path, data_dir, instance,
                                                                                    monkeypatch):
    engine = LabelEngine()
    prices = tmp_path / "prices.toml"
    prices.write_text(textwrap.dedent("""
        [defaults]
        input_per_1m = 1000000.0
        output_per_1m = 1000000.0
        batch_discount = 0.0
    """))
    request = {**component_yaml()["attributes"]["request"], "params": {"temperature": 0, "max_tokens": 5}}
    with table_project(component_yaml(reuse=False, max_cost=100.0, request=request),
                 component_yaml(reuse=False, max_cost=10.0, asset={"key": "refused"})) as (defs, tables):
        tables["reviews"] = reviews_frame()
        # Its estimate's upper bound passes (one token per request, as the stand-in counts); its spend does not.
        monkeypatch.setattr(Models, "counter", lambda self, model, **kw: (lambda endpoint, body: [1], 2048))
        res = table_resources(data_dir, engine, "cap", prices_file=str(prices))
        res[PIPELINE] = PipelineConfig(shard_size=3, prices_file=str(prices))
        result = materialize(defs, ["reviews", "review_labels"], res, instance, raise_on_error=False)
        assert result.success
        labels, meta = labels_of(result)
        assert engine.ran == ["row-0", "row-1", "row-2"]  # the first shard spent past the cap
        assert labels["error_code"].tolist()[3:] == [c.COST_LIMIT_EXCEEDED] * 5
        assert result.get_asset_check_evaluations()[0].passed
        # A batch whose upper bound is past its cap is refused before it runs, saying so.
        refused = materialize(defs, ["reviews", "refused"], res, instance, raise_on_error=False)
        message = next(e for e in refused.all_events if e.is_step_failure).step_failure_data.error.message
        assert "[cost_limit_exceeded]" in message and "max_cost 10" in message and len(engine.ran) == 3


def test_the_answer_store_is_kept_where_the_batch_folders_are(tmp_path, data_dir, instance):
    engine = LabelEngine()
    with table_project(component_yaml()) as (defs, tables):
        tables["reviews"] = reviews_frame()
        materialize(defs, ["reviews", "review_labels"], table_resources(data_dir, engine, "store"), instance)
    store = AnswerStore(StorageResource(data_dir=str(data_dir)).open())
    assert len(store.ledgers()) == 3 and store.size() > 0  # one ledger per shard of 3


def test_on_s3_the_answered_table_and_the_answer_store_live_in_the_bucket(tmp_path, data_dir, instance, bucket):
    from tests.helpers import BUCKET

    engine = LabelEngine()
    url = f"s3://{BUCKET}/batch-data"
    with table_project(component_yaml()) as (defs, tables):
        tables["reviews"] = reviews_frame()
        res = table_resources(data_dir, engine, "s3-tables")
        res[STORAGE], res[IO_MANAGER] = StorageResource(data_dir=str(data_dir), url=url), \
            TableIOManager(data_dir=str(data_dir), url=url)
        materialize(defs, ["reviews", "review_labels"], res, instance)
        engine.ran.clear()
        labels, meta = labels_of(materialize(defs, ["reviews", "review_labels"], res, instance))
    assert (meta["reused"], engine.ran) == (8, [])  # every answer found again in the bucket
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix="batch-data/")["Contents"]]
    assert "batch-data/tables/review_labels/table.parquet" in keys
    assert any(k.startswith("batch-data/answers/entries/") for k in keys)
    assert not any(k.startswith("batch-data/batches/") for k in keys)  # the batch's folder is gone once answered


def test_a_project_s_table_batch_touches_no_metadata_store(tmp_path, data_dir, instance):
    """The component's resources as its definitions build them (only the engine faked): a project has no API store,
    and nothing of a table batch opens one (the settings' default would create data/batch-api.db)."""
    engine = LabelEngine()
    with table_project(component_yaml()) as (defs, tables):
        assert "database" not in defs.resources  # the steps then run with no session of a store
        tables["reviews"] = reviews_frame()
        res = {**defs.resources, VLLM: fake_vllm("no-store", engine)}
        labels, meta = labels_of(materialize(defs, ["reviews", "review_labels"], res, instance))
    assert meta["answered"] == 8 and meta.get("estimated_cost_max", 0) > 0
    assert not list(data_dir.glob("*.db*")) and (data_dir / "tables" / "review_labels" / "table.parquet").exists()


def test_table_batches_share_answers_within_their_namespace_only(tmp_path, data_dir, instance):
    """A table batch's answers are its namespace's: by default its project's (its components share them); a component
    naming another namespace meets none of them, unless the operator shares the two (BATCH_SHARED_OWNERS)."""
    engine = LabelEngine()
    with table_project(component_yaml(), component_yaml(asset={"key": "labels_too"}),
                       component_yaml(asset={"key": "other_team"}, namespace="other")) as (defs, tables):
        tables["reviews"] = reviews_frame()
        res = table_resources(data_dir, engine, "namespaces")
        materialize(defs, ["reviews", "review_labels"], res, instance)
        _, same = labels_of(materialize(defs, ["reviews", "labels_too"], res, instance), "labels_too")
        assert (same["reused"], same["computed"]) == (8, 0)  # the project's two components share
        _, other = labels_of(materialize(defs, ["reviews", "other_team"], res, instance), "other_team")
        assert (other["reused"], other["computed"]) == (0, 8)  # another namespace: nothing of theirs
        res[PIPELINE] = PipelineConfig(shard_size=3, shared_owners=["*"])
        _, shared = labels_of(materialize(defs, ["reviews", "other_team"], res, instance), "other_team")
        assert shared["computed"] == 8  # the shared scope is a new one: computed once there...
        _, again = labels_of(materialize(defs, ["reviews", "labels_too"], res, instance), "labels_too")
        assert (again["reused"], again["computed"]) == (8, 0)  # ...and met by every owner the operator shares


def test_the_component_takes_its_option_fields_from_the_batch_options():
    """A table batch's options are a batch's (BatchOptions): the same names, defaults and meanings in its YAML;
    those it leaves unset are a table batch's defaults (answers reused), then the operator's."""
    from batch_dagster.batchfile.options import BatchOptions
    from batch_dagster.defs.table.component import TableBatchComponent
    from batch_dagster.defs.table.run import TABLE_DEFAULTS

    fields = TableBatchComponent.model_fields
    for name, info in BatchOptions.model_fields.items():
        assert (fields[name].default, fields[name].description) == (info.default, info.description), name
    assert BatchOptions().resolved(TABLE_DEFAULTS) == BatchOptions(reuse=True)
