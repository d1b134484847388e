"""The Dagster pipeline on a fake engine: lineage, checks, skipping committed shards, failures."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import pytest

from batch_dagster.batchfile.contract import RequestCounts
from batch_dagster.batchfile.folder import batch_ids
from batch_dagster.batchfile.results import committed_shards, shard_keys
from batch_dagster.definitions import defs
from batch_dagster.defs.resources import StorageResource
from batch_dagster.defs.runner import run_batch
from batch_dagster.settings import Settings
from tests.helpers import FakeEngine, chat_request, fake_vllm, local_file, make_defs, read_jsonl, write_jsonl


def test_project_definitions_load():
    project_defs = defs()
    job = project_defs.resolve_job_def("batch_job")
    keys = {k.to_user_string() for k in project_defs.resolve_all_asset_keys()}
    lifecycle = {"batch_input", "validated_requests", "batch_shards", "shard_results", "batch_output_files", "batch_usage"}
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == lifecycle
    assert keys >= lifecycle | {"delivered_results"}
    sensors = {s.name for s in project_defs.sensors}
    assert sensors >= {"api_batch_sensor", "api_batch_status_sensor", "s3_upload_sensor", "inbox_sensor", "queue_eta_sensor"}
    assert job.partitions_def.name == "batches"
    checks = {k.name for k in project_defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"unique_custom_ids", "every_custom_id_exactly_once", "usage_equals_output_lines"}
    shard_results = project_defs.resolve_assets_def("shard_results")
    # Runs, not steps, are bounded (the run queue, by their tags): an inference step waits for no pool.
    assert shard_results.op.pool is None
    assert shard_results.op.retry_policy.max_retries >= 1


def test_importing_the_definitions_reads_no_setting_and_no_store(tmp_path):
    """The definitions are built when Dagster loads them: an import parses no setting and opens no store."""
    code = ("import batch_dagster.definitions as d; print('imported'); d.defs()")
    env = {**os.environ, "BATCH_SHARD_SIZE": "many", "BATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'store.db'}"}
    env.pop("BATCH_REPORT_START", None)  # unset: the store's first batch decides, read when they load
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.stdout.strip() == "imported" and "BATCH_SHARD_SIZE='many'" in out.stderr  # read when they load


def test_batch_materializes_with_lineage_and_passing_checks(tmp_path, data_dir, instance):
    engine = FakeEngine()
    defs = make_defs(data_dir, fake_vllm("lineage", engine), shard_size=4)
    rows = [chat_request(f"r{i}", f"question number {i} " + "pad " * i, max_tokens=8) for i in range(10)]
    rows.append(chat_request("bad-temp", "hi", temperature=-1))
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()

    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 11, "completed": 10, "failed": 1}
    out, err = read_jsonl(tmp_path / "out" / "output.jsonl"), read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert sorted(line["custom_id"] for line in out + err) == sorted(r["custom_id"] for r in rows)
    assert err[0]["response"]["status_code"] == 400 and err[0]["response"]["body"]["error"]["param"] == "temperature"
    assert summary["usage"]["output_tokens"] == sum(l["response"]["body"]["usage"]["completion_tokens"] for l in out)
    assert summary["cost"]["total_cost"] > 0
    assert len(engine.calls) == 3  # 11 requests in shards of 4

    batch_id = summary["batch_id"]
    # The progress document (what the status sensor reads of a running batch) holds the committed totals after the
    # last shard's marker, nothing live.
    progress = StorageResource(data_dir=str(data_dir)).folder(batch_id).progress()
    assert (progress.shard, progress.done, progress.shards_committed, progress.shard_count) == (None, 0, 3, 3)
    assert progress.request_counts == RequestCounts(total=11, completed=10, failed=1)
    assert progress.usage.output_tokens == summary["usage"]["output_tokens"] and progress.committed_at is not None
    assert batch_id in instance.get_dynamic_partitions("batches")
    for key in ("batch_input", "validated_requests", "batch_shards", "shard_results", "batch_output_files", "batch_usage"):
        assert instance.get_latest_materialization_event(dg.AssetKey(key)) is not None, key
    checks = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("batch_output_files"), "every_custom_id_exactly_once"), limit=1
    )
    assert checks and checks[0].status.value == "SUCCEEDED"


def test_a_model_missing_from_the_price_table_is_said_where_its_cost_is(tmp_path, data_dir, instance):
    prices = tmp_path / "prices.toml"
    prices.write_text('[defaults]\ninput_per_1m = 0.0\noutput_per_1m = 0.0\n\n[models.other]\ninput_per_1m = 1.0\n')
    defs = make_defs(data_dir, fake_vllm("unpriced", FakeEngine()), prices_file=str(prices))
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", [chat_request("a", "hi")]), tmp_path / "out",
                        show_progress=False, defs=defs, instance=instance).to_dict()
    assert summary["status"] == "completed" and summary["cost"]["total_cost"] == 0
    usage = instance.get_latest_materialization_event(dg.AssetKey("batch_usage")).asset_materialization
    assert usage.metadata["price"].value == f"not in the price table: its [defaults] ({prices})"
    logs = [e.message for e in instance.all_logs(instance.get_runs(limit=1)[0].run_id)]
    assert any("'smollm2-135m-instruct' is not in the price table" in m and str(prices) in m for m in logs), logs


def test_rerun_skips_committed_shards(tmp_path, data_dir, instance):
    engine = FakeEngine()
    defs = make_defs(data_dir, fake_vllm("rerun", engine), shard_size=3)
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(9)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    batch_id = summary["batch_id"]
    assert len(engine.calls) == 3
    folder = StorageResource(data_dir=str(data_dir)).folder(batch_id)
    # Lose one committed shard, as if the run had died before committing it.
    folder.storage.delete(shard_keys(folder.results_prefix, 1)[2])

    result = defs.resolve_job_def("batch_job").execute_in_process(partition_key=batch_id, instance=instance)
    assert result.success
    assert len(engine.calls) == 4  # only the lost shard ran again
    assert sorted(committed_shards(folder.storage, folder.results_prefix)) == [0, 1, 2]
    ids = [l["custom_id"] for l in read_jsonl(local_file(folder, folder.output_key))]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # rewritten whole, not doubled


def test_the_progress_document_counts_the_committed_shards_never_ahead_of_their_markers(tmp_path, data_dir,
                                                                                        instance):
    # What the status sensor reads of a running batch, in place of its markers: at every finished request, the
    # committed totals are the markers' own, beside the live shard's count.
    storage = StorageResource(data_dir=str(data_dir))
    seen = []

    def check(done_in_shard: int) -> None:
        [batch_id] = batch_ids(storage.open())
        folder = storage.folder(batch_id)
        progress = folder.progress()
        markers = committed_shards(folder.storage, folder.results_prefix)
        assert (progress.shards_committed, progress.request_counts.completed) == (
            len(markers), sum(s.request_counts.completed for s in markers.values()))
        seen.append((progress.shard, progress.done, progress.shards_committed, progress.counts().completed))

    engine = FakeEngine(on_request=check)
    defs = make_defs(data_dir, fake_vllm("progress", engine), shard_size=3)
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(7)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert seen == [(0, 1, 0, 1), (0, 2, 0, 2), (0, 3, 0, 3), (1, 1, 1, 4), (1, 2, 1, 5), (1, 3, 1, 6), (2, 1, 2, 7)]
    folder = storage.folder(summary["batch_id"])
    assert folder.progress().shards_committed == 3

    # A marker lost (the run died before it): the document said more, and the next attempt rewrites it first.
    folder.storage.delete(shard_keys(folder.results_prefix, 1)[2])
    seen.clear()
    assert defs.resolve_job_def("batch_job").execute_in_process(partition_key=summary["batch_id"],
                                                                instance=instance).success
    assert seen == [(1, 1, 2, 5), (1, 2, 2, 6), (1, 3, 2, 7)]
    assert (folder.progress().shards_committed, folder.progress().request_counts.completed) == (3, 7)


def test_invalid_file_fails_the_batch_and_runs_nothing(tmp_path, data_dir, instance):
    engine = FakeEngine()
    defs = make_defs(data_dir, fake_vllm("invalid", engine))
    rows = [chat_request("a", "hi"), "{not json", chat_request("a", "dup"), chat_request("b", "x", model="nope")]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert summary["status"] == "failed"
    codes = [(e["code"], e["line"]) for e in summary["errors"]]
    assert codes == [("invalid_json", 2), ("duplicate_custom_id", 3), ("mixed_models", 4)]
    assert engine.calls == []
    assert (tmp_path / "out" / "output.jsonl").read_bytes() == b""


def test_engine_crash_retries_then_succeeds(tmp_path, data_dir, instance):
    engine = FakeEngine(crash_times=1)
    defs = make_defs(data_dir, fake_vllm("crash-once", engine), shard_size=2)
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(4)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert len(engine.calls) == 3  # crash, then both shards


def test_engine_crash_past_retries_becomes_engine_error_lines(tmp_path, data_dir, instance):
    engine = FakeEngine(crash_times=3)  # the first shard crashes on every attempt
    defs = make_defs(data_dir, fake_vllm("crash-always", engine), shard_size=2)
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(4)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    err = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert {e["response"]["body"]["error"]["code"] for e in err} == {"engine_error"}
    assert {e["response"]["status_code"] for e in err} == {500}


@pytest.mark.parametrize("bad", ["", "\n\n"])
def test_empty_file_fails(tmp_path, data_dir, instance, bad):
    defs = make_defs(data_dir, fake_vllm("empty", FakeEngine()))
    path = tmp_path / "in.jsonl"
    path.write_text(bad)
    summary = run_batch(path, tmp_path / "out", show_progress=False, defs=defs, instance=instance).to_dict()
    assert summary["status"] == "failed"
    assert summary["errors"][0]["code"] == "empty_file"


@pytest.mark.parametrize("reason, code", [("cancelled", "batch_cancelled"), ("expired", "batch_expired")])
def test_stopped_batch_keeps_finished_shards_and_accounts_for_the_rest(tmp_path, data_dir, instance,
                                                                        reason, code):
    storage = StorageResource(data_dir=str(data_dir))
    engine = FakeEngine()
    defs = make_defs(data_dir, fake_vllm(f"stop-{reason}", engine), shard_size=2)

    def stop_after_first_shard(n):
        batch_id = next(iter(instance.get_dynamic_partitions("batches")))
        if reason == "cancelled":
            storage.folder(batch_id).request_stop("cancelled")
        else:
            storage.folder(batch_id).set_deadline(0.0)

    engine.on_call = stop_after_first_shard
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(6)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert summary["status"] == reason
    assert len(engine.calls) == 1
    assert summary["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    out, err = read_jsonl(tmp_path / "out" / "output.jsonl"), read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert sorted(l["custom_id"] for l in out + err) == sorted(r["custom_id"] for r in rows)
    assert {e["error"]["code"] for e in err} == {code} and all(e["response"] is None for e in err)


def fail_from_call(n: int):
    """An engine hook that fails its `n`-th call and every later one, with an error that no step retry fixes."""
    def hook(call: int) -> None:
        if call >= n:
            raise dg.Failure("the batch store is unreachable (injected)", allow_retries=False)
    return hook


def test_a_run_that_fails_for_good_keeps_the_committed_shards(tmp_path, data_dir, instance, capsys):
    from batch_dagster.cli import _print_summary

    engine = FakeEngine(on_call=fail_from_call(2))  # shard 0 commits, then the run fails for good at shard 1
    defs = make_defs(data_dir, fake_vllm("fails-for-good", engine), shard_size=2)
    rows = [chat_request(f"r{i}", f"question {i} " + "pad " * i, max_tokens=8) for i in range(6)]
    run = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                    defs=defs, instance=instance)
    summary = run.to_dict()

    assert summary["status"] == "failed"
    assert summary["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    [error] = summary["errors"]
    assert error["code"] == "pipeline_error" and "injected" in error["message"]
    out, err = read_jsonl(tmp_path / "out" / "output.jsonl"), read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert [l["custom_id"] for l in out] == engine.calls[0]  # the committed shard's answers
    assert sorted(l["custom_id"] for l in out + err) == sorted(r["custom_id"] for r in rows)  # each once
    assert {e["error"]["code"] for e in err} == {"batch_failed"} and all(e["response"] is None for e in err)
    assert all("run failed" in e["error"]["message"] and "injected" in e["error"]["message"] for e in err)
    # Billed: the successful requests only.
    assert summary["usage"]["output_tokens"] == sum(l["response"]["body"]["usage"]["completion_tokens"] for l in out)
    assert summary["usage"]["output_tokens"] > 0 and 0 < summary["cost"]["total_cost"]
    folder = StorageResource(data_dir=str(data_dir)).folder(summary["batch_id"])
    assert folder.summary().status == "failed" and folder.summary().errors[0].code == "pipeline_error"
    _print_summary(run, Settings.from_env())  # what `batch-dagster run` prints: the failure, and what it kept
    printed = capsys.readouterr()
    assert "failed" in printed.out and "[pipeline_error]" in printed.err
    assert "requests: 6 total, 2 completed, 4 failed" in printed.out and str(tmp_path / "out") in printed.out


def test_a_terminated_run_stops_instead_of_retrying_the_step(tmp_path, data_dir, instance):
    def terminated(call: int) -> None:
        if call >= 2:  # the UI's Terminate: the run is marked CANCELING, then Dagster interrupts the step
            [run] = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
            instance.report_run_canceling(run)
            raise dg.DagsterExecutionInterruptedError()

    engine = FakeEngine(on_call=terminated)
    defs = make_defs(data_dir, fake_vllm("terminated", engine), shard_size=2)
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(6)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs, instance=instance).to_dict()
    assert len(engine.calls) == 2  # not run on by the step's RetryPolicy
    assert summary["status"] == "failed" and "terminated" in summary["errors"][0]["message"]
    assert summary["request_counts"] == {"total": 6, "completed": 2, "failed": 4}


def test_a_store_that_fails_the_live_progress_write_costs_the_shard_nothing(tmp_path):
    """The live counts are written as a shard goes on; a store that refuses one write (S3 unreachable for a moment)
    is a warning in the step's log, not an exception that throws away the shard's answers."""
    from batch_dagster.batchfile.folder import BatchFolder, Progress
    from batch_dagster.defs.assets.inference import ShardProgress
    from batch_dagster.storage import LocalStorage

    class Refusing(BatchFolder):
        def write_progress(self, progress: Progress) -> None:
            raise OSError("Could not connect to the endpoint URL")

    class Log:
        def __init__(self) -> None:
            self.warnings: list[str] = []

        def warning(self, message: str) -> None:
            self.warnings.append(message)

        def info(self, message: str) -> None:
            pass

    log = Log()
    progress = ShardProgress(Refusing(LocalStorage(tmp_path), "batch_x"), Progress(), index=0, size=4, log=log)
    for _ in range(4):
        progress(1)
    assert progress.done == 4
    assert log.warnings and "Could not connect to the endpoint URL" in log.warnings[0]


def test_a_later_shard_runs_the_group_that_wrote_more_of_what_it_asked_first(tmp_path, data_dir, instance):
    """The longest work first, as the batch's earlier shards wrote it: labels ask 1,000 tokens and write 3 (the
    fake engine writes a word per word of the question), translations ask 200 and write them all. The first shard
    is all labels; in the second, the translations go before the last labels, which asked five times as much and
    are more."""
    engine = FakeEngine()
    defs = make_defs(data_dir, fake_vllm("shares", engine), shard_size=5)
    labels = [chat_request(f"label{i}", "x" * 256 + f" label{i}", max_tokens=1000) for i in range(8)]
    translations = [chat_request(f"tr{i}", "y" * 256 + f" tr{i}" + " w" * 250, max_tokens=200) for i in range(2)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", labels + translations), tmp_path / "out",
                        show_progress=False, defs=defs, instance=instance).to_dict()
    assert summary["request_counts"]["completed"] == 10
    assert engine.calls == [[f"label{i}" for i in range(5)], ["tr0", "tr1", "label5", "label6", "label7"]]
