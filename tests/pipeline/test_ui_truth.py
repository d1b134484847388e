"""An invalid file is a result, not a red pipeline: downstream steps and checks are skipped, never failed;
runs and materializations carry readable labels."""

from __future__ import annotations

import dagster as dg

from batch_dagster.defs.runner import run_batch
from tests.helpers import FakeEngine, chat_request, fake_vllm, make_defs, rows, write_jsonl

DOWNSTREAM = ("batch_shards", "shard_results", "batch_output_files", "batch_usage")


def _step_events(instance: dg.DagsterInstance, run_id: str, kind: dg.DagsterEventType) -> list[str]:
    return [r.event_log_entry.dagster_event.step_key
            for r in instance.get_records_for_run(run_id, of_type=kind).records]


def test_an_invalid_file_skips_the_later_steps_and_checks_instead_of_failing_them(tmp_path, data_dir, instance):
    engine = FakeEngine()
    defs = make_defs(data_dir, fake_vllm("ui-invalid", engine))
    bad = [chat_request("a", "hi"), "{not json", chat_request("a", "dup")]
    summary = run_batch(write_jsonl(tmp_path / "bad.jsonl", bad), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert summary["status"] == "failed" and [e["code"] for e in summary["errors"]] == ["invalid_json",
                                                                                      "duplicate_custom_id"]
    run = instance.get_run_by_id(summary["run_id"])
    assert run.status == dg.DagsterRunStatus.SUCCESS
    assert _step_events(instance, run.run_id, dg.DagsterEventType.STEP_FAILURE) == []
    skipped = set(_step_events(instance, run.run_id, dg.DagsterEventType.STEP_SKIPPED))
    assert set(DOWNSTREAM) <= skipped and "unique_custom_ids" in " ".join(skipped)
    for key in ("validated_requests", *DOWNSTREAM):
        assert instance.get_latest_materialization_event(dg.AssetKey(key)) is None, key
    # No check of the batch is marked failed (or "execution failed"): they did not run.
    for asset, check in (("validated_requests", "unique_custom_ids"),
                         ("batch_output_files", "every_custom_id_exactly_once"),
                         ("batch_usage", "usage_equals_output_lines")):
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey(asset), check), limit=5)
        assert all(h.status.value not in ("FAILED", "EXECUTION_FAILED") for h in history), (check, history)
    # The errors stay visible: an `invalid` observation of validated_requests with the error table.
    [obs] = [r.event_log_entry.asset_observation for r in instance.fetch_observations(
        dg.AssetKey("validated_requests"), limit=5).records]
    assert obs.partition == summary["batch_id"]
    meta = {k: v.value for k, v in obs.metadata.items()}
    assert meta["status"] == "invalid" and meta["error_count"] == 2 and "invalid_json" in meta["errors"]
    assert meta["filename"] == "bad.jsonl" and meta["source"] == "cli"
    assert run.tags["validation"] == "invalid" and run.tags["requests"] == "3"
    assert engine.calls == []


def test_runs_and_materializations_carry_readable_labels(tmp_path, data_dir, instance):
    defs = make_defs(data_dir, fake_vllm("ui-labels", FakeEngine()))
    summary = run_batch(write_jsonl(tmp_path / "questions.jsonl", rows(3)), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    run = instance.get_run_by_id(summary["run_id"])
    assert {k: run.tags.get(k) for k in ("batch_id", "source", "filename", "owner", "model", "requests")} == {
        "batch_id": summary["batch_id"], "source": "cli", "filename": "questions.jsonl", "owner": "anonymous",
        "model": summary["model"], "requests": "3"}
    event = instance.get_latest_materialization_event(dg.AssetKey("validated_requests"))
    meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert meta["status"] == "valid" and meta["filename"] == "questions.jsonl" and meta["total_requests"] == 3
    event = instance.get_latest_materialization_event(dg.AssetKey("batch_input"))
    assert event.asset_materialization.metadata["filename"].value == "questions.jsonl"
