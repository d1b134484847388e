"""Tables through the drop folders: a Parquet or CSV file dropped with its sidecar (what to ask, of which model,
with which schema) is answered into a table of the same format, written with its batch's other results."""

from __future__ import annotations

import io
import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batch_dagster.batchfile.table_files import read_table
from batch_dagster.defs.sensors import inbox_sensor, s3_upload_sensor
from tests.helpers import BUCKET, SCHEMA, Daemon, LabelEngine, fake_vllm, reviews_frame, s3_json

SIDECAR = {"model": "smollm2-135m-instruct", "system": "Label the review as JSON.",
           "user": "Review ({stars} stars): {text}", "params": {"temperature": 0, "max_tokens": 40},
           "json_schema": SCHEMA, "key_columns": ["review_id"]}


def _settled(path) -> None:
    """Backdate a file so the inbox takes it as complete (it must be unchanged across two ticks too)."""
    past = time.time() - 60
    os.utime(path, (past, past))


def test_a_csv_dropped_with_its_sidecar_is_answered_into_a_csv(tmp_path):
    engine = LabelEngine()
    daemon = Daemon(tmp_path, fake_vllm("table-inbox", engine))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    frame = reviews_frame()
    frame.loc[3, "text"] = None  # an empty cell: that row's error, the others answered
    frame.to_csv(inbox / "reviews.csv", index=False)
    _settled(inbox / "reviews.csv")
    assert daemon.tick(inbox_sensor) == [] and daemon.tick(inbox_sensor) == []  # no sidecar yet: it waits

    (inbox / "reviews.batch.yaml").write_text(yaml.safe_dump(SIDECAR, sort_keys=False))
    _settled(inbox / "reviews.batch.yaml")
    daemon.tick(inbox_sensor, run=False)  # seen once
    runs = daemon.until_delivered(inbox_sensor)
    assert [job for job, _ in runs] == ["batch_job", "deliver_results_job"]
    results = tmp_path / "outbox" / runs[0][1]
    assert sorted(p.name for p in results.iterdir()) == ["errors.jsonl", "output.jsonl", "reviews.answers.csv",
                                                         "summary.json"]
    answers = read_table(results / "reviews.answers.csv").to_pylist()  # as a CSV reader that takes "" as empty
    assert [a["review_id"] for a in answers] == frame["review_id"].tolist()
    assert answers[0]["sentiment"] == "positive" and answers[1]["sentiment"] == "negative"
    assert answers[3]["error_code"] == "empty_value" and answers[3]["error"] == \
        "Column 'text' is empty in this row. (field: user)"
    assert sum(a["error_code"] is None for a in answers) == 7 and len(engine.ran) == 7
    summary = json.loads((results / "summary.json").read_text())
    assert summary["request_counts"] == {"total": 7, "completed": 7, "failed": 0}  # the requests the rows made
    assert daemon.tick(inbox_sensor) == []  # the sidecar is no batch of its own, the table is taken once


def test_a_parquet_table_dropped_in_the_bucket_is_answered_into_parquet(tmp_path, bucket):
    daemon = Daemon(tmp_path, fake_vllm("table-s3", LabelEngine()))
    data = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(reviews_frame(), preserve_index=False), data)
    bucket.put_object(Bucket=BUCKET, Key="incoming/week1.parquet", Body=data.getvalue())
    assert daemon.tick(s3_upload_sensor) == []  # no sidecar yet
    bucket.put_object(Bucket=BUCKET, Key="incoming/week1.batch.yaml", Body=yaml.safe_dump(SIDECAR).encode())
    runs = daemon.until_delivered(s3_upload_sensor)
    prefix = f"results/{runs[0][1]}/"
    body = bucket.get_object(Bucket=BUCKET, Key=prefix + "week1.answers.parquet")["Body"].read()
    answers = pq.read_table(io.BytesIO(body))
    assert answers.schema.field("confidence").type == pa.float64()
    assert answers.column("sentiment").to_pylist()[:2] == ["positive", "negative"]
    assert s3_json(bucket, prefix + "summary.json")["status"] == "completed"


def test_a_sidecar_that_asks_what_no_row_could_run_ends_the_batch_failed_saying_which_field(tmp_path):
    daemon = Daemon(tmp_path, fake_vllm("table-bad", LabelEngine()))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    reviews_frame().to_csv(inbox / "reviews.csv", index=False)
    bad = {**SIDECAR, "json_schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}
    (inbox / "reviews.batch.yaml").write_text(yaml.safe_dump(bad))
    for name in ("reviews.csv", "reviews.batch.yaml"):
        _settled(inbox / name)
    daemon.tick(inbox_sensor, run=False)
    runs = daemon.until_delivered(inbox_sensor)
    summary = json.loads((tmp_path / "outbox" / runs[0][1] / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "reviews.batch.yaml: json_schema.properties.a.type: not valid JSON Schema" in \
        summary["errors"][0]["message"]
