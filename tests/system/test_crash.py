"""Crashes under the real Dagster daemon and the project's dagster.yaml: processes killed with SIGKILL mid-batch.

batch_job runs its steps in the run worker's own process (the in-process executor). A crashed engine (its
model worker killed) fails the shard: the step is retried in the same run (the op's RetryPolicy) with a new
engine. A killed run worker is retried as a new run (`run_retries`), and its engine does not outlive it.
Either way committed shards are kept, and every custom_id ends up in the output or error file exactly once.
A batch whose runs keep dying, or whose run is terminated, fails with the reason and keeps what it finished.
"""

from __future__ import annotations

import json
import time

import dagster as dg
import openai
import psutil
import pytest

from tests.daemon_defs import engine_calls
from tests.helpers import (
    Serve,
    batch_runs,
    chat_request,
    committed_files,
    committed_in,
    file_stats,
    materialization_metadata,
    read_jsonl,
    step_events,
    wait_until,
)

SHARDS = 8


def lines(client, file_id) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


@pytest.mark.engine
def test_crashed_engine_and_killed_run_worker_resume_without_redoing_shards(tmp_path):
    # Every request decodes 40 tokens, so a shard of 4 takes about a second: there is always one in flight.
    rows = [chat_request(f"q{i:02d}", f"Say the number {i} and name a color.", max_tokens=40, min_tokens=40,
                         temperature=0) for i in range(4 * SHARDS)]
    with Serve(tmp_path, BATCH_SHARD_SIZE="4") as serve:
        batch = serve.create_batch(rows)
        results = serve.data_dir / "batches" / batch.id / "results"

        # 1. Once the first shard is committed, kill -9 the engine's model worker mid-inference (the process the
        # OOM killer would pick: it holds the weights and the KV cache). The engine crashed.
        worker, core = wait_until(lambda: committed_in(results) and serve.engine_holder(), 240, serve,
                                  "no shard committed")
        [model_worker] = [p for p in core.children() if p.name().startswith("VLLM::Worker")]
        model_worker.kill()
        model_worker.wait(10)
        after_engine_kill = file_stats(committed_files(results))
        assert 3 <= len(after_engine_kill) < 3 * SHARDS

        # 2. The op's RetryPolicy runs the step again in the same run worker, with a new engine. Once it has
        # committed a shard of its own, kill -9 the run worker.
        holder = wait_until(lambda: len(committed_files(results)) > len(after_engine_kill) and serve.engine_holder(),
                            180, serve, "the retried step committed nothing")
        assert holder[0].pid == worker.pid and holder[1].pid != core.pid
        engine = [holder[1], *holder[1].children(recursive=True)]
        worker.kill()
        worker.wait(10)
        # Its engine goes with it, instead of holding its memory while the run's retry starts another.
        gone, alive = psutil.wait_procs(engine, timeout=15)
        assert not alive, alive
        after_worker_kill = file_stats(committed_files(results))
        assert len(after_worker_kill) < 3 * SHARDS

        done = serve.wait_for(batch.id, {"completed", "failed", "cancelled", "expired"}, 300)
        client = serve.client()
        out, err = lines(client, done.output_file_id), lines(client, done.error_file_id)
        with serve.instance() as instance:
            runs = batch_runs(instance, batch.id)
            retries = [len(step_events(instance, r.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY, "shard_results"))
                       for r in runs]
            resumed = materialization_metadata(instance, runs[-1].run_id, "shard_results")

    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 4 * SHARDS, "completed": 4 * SHARDS, "failed": 0}
    # Every custom_id exactly once, none lost with the killed processes, none written twice.
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)
    assert done.usage.output_tokens == 40 * 4 * SHARDS
    # Shards committed before each kill were never recomputed: not one of their files was rewritten.
    now = file_stats(committed_files(results))
    assert {name: now[name] for name in after_engine_kill} == after_engine_kill
    assert {name: now[name] for name in after_worker_kill} == after_worker_kill
    assert resumed["shards_skipped"] == len(after_worker_kill) // 3
    assert resumed["shards_run"] == SHARDS - len(after_worker_kill) // 3

    # The engine crash was retried inside the first run; the worker kill by a new run, Dagster's run retry.
    first, retry = runs
    assert retries == [1, 0]
    assert first.status == dg.DagsterRunStatus.FAILURE and first.tags["dagster/will_retry"] == "true"
    assert first.tags["dagster/auto_retry_run_id"] == retry.run_id
    assert retry.status == dg.DagsterRunStatus.SUCCESS
    assert retry.tags["dagster/retry_number"] == "1" and retry.tags["dagster/parent_run_id"] == first.run_id
    assert retry.tags["dagster/is_resume_retry"] == "true" and retry.tags["dagster/partition"] == batch.id


def test_serve_stopped_mid_run_then_every_retry_dying_fails_the_batch_with_the_reason(tmp_path):
    # 5 shards of 2. Under the first serve each engine call takes 8 s: the run outlives serve's grace
    # period after Ctrl-C and is killed with its process group, code server included.
    calls = tmp_path / "calls.jsonl"
    rows = [chat_request(f"r{i}", f"question {i}", max_tokens=4) for i in range(10)]
    env = {"module": "tests.daemon_defs", "BATCH_SHARD_SIZE": "2", "BATCH_TEST_CALLS": str(calls)}
    with Serve(tmp_path, **env, BATCH_TEST_CALL_S="8") as serve:
        batch = serve.create_batch(rows)
        results = serve.data_dir / "batches" / batch.id / "results"
        wait_until(lambda: committed_in(results), 120, serve, "no shard committed")
    stopped = file_stats(committed_files(results))
    kept = {x["custom_id"] for p in committed_files(results) if p.name.endswith(".output.jsonl") for x in read_jsonl(p)}
    calls_before = len(engine_calls(calls))
    with serve.instance() as instance:
        [stuck] = batch_runs(instance, batch.id, timeout_s=0)
    assert stuck.status == dg.DagsterRunStatus.STARTED  # nothing is left that could mark it failed

    # Started again, the status sensor finds the run's code server gone and marks it failed, and Dagster
    # retries it. Here every retry's worker is killed at its first engine call, until retries run out.
    with Serve(tmp_path, **env, BATCH_TEST_KILL_ON_CALL="1") as serve:
        failed = serve.wait_for(batch.id, {"completed", "failed"}, 180)
        with serve.instance() as instance:
            runs = batch_runs(instance, batch.id)
        out, err = lines(serve.client(), failed.output_file_id), lines(serve.client(), failed.error_file_id)

    assert [r.status for r in runs] == [dg.DagsterRunStatus.FAILURE] * 3
    assert [r.tags.get("dagster/retry_number") for r in runs] == [None, "1", "2"]
    assert [r.tags.get("dagster/will_retry") for r in runs] == ["true", "true", "false"]
    # The shards committed before serve stopped were kept and never run again.
    assert file_stats(committed_files(results)) == stopped
    assert kept and not kept & {cid for c in engine_calls(calls)[calls_before:] for cid in c["custom_ids"]}

    assert failed.status == "failed" and failed.failed_at is not None
    # It keeps what it finished: the shards committed before serve stopped; every other request is an error line.
    assert failed.request_counts.model_dump() == {"total": 10, "completed": len(kept), "failed": 10 - len(kept)}
    [error] = failed.errors.data
    assert error.code == "pipeline_error"
    assert f"Dagster run {runs[-1].run_id}, retry 2" in error.message and "signal 9 (SIGKILL)" in error.message
    assert {x["custom_id"] for x in out} == kept
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)
    assert {e["error"]["code"] for e in err} == {"batch_failed"}


@pytest.mark.engine
def test_a_run_terminated_after_a_shard_committed_keeps_it_and_retry_runs_the_rest(tmp_path):
    # 8 shards of 4 requests of 40 tokens each: the run is still inferring when it is terminated.
    rows = [chat_request(f"q{i:02d}", f"Say the number {i} and name a color.", max_tokens=40, min_tokens=40,
                         temperature=0) for i in range(4 * SHARDS)]
    with Serve(tmp_path, BATCH_SHARD_SIZE="4") as serve:
        client = serve.client()
        batch = serve.create_batch(rows)
        results = serve.data_dir / "batches" / batch.id / "results"
        wait_until(lambda: committed_in(results), 240, serve, "no shard committed")
        with serve.instance() as instance:
            [run] = instance.get_runs(dg.RunsFilter(job_name="batch_job", tags={"dagster/partition": batch.id}))
            instance.run_coordinator.cancel_run(run.run_id)  # what the UI's Terminate does
            [ended] = batch_runs(instance, batch.id, timeout_s=120)
        failed = serve.wait_for(batch.id, {"completed", "failed", "cancelled"}, 120)
        kept = {x["custom_id"] for p in committed_files(results) if p.name.endswith(".output.jsonl")
                for x in read_jsonl(p)}
        out, err = lines(client, failed.output_file_id), lines(client, failed.error_file_id)

        retried = client.post(f"/batches/{batch.id}/retry", cast_to=openai.types.Batch)
        child = serve.wait_for(retried.id, {"completed", "failed"}, 600)
        child_out = lines(client, child.output_file_id)
        merged = client.get(f"/files/{child.output_file_id}/content", cast_to=str, options={"params": {"merged": "true"}})

    assert ended.status == dg.DagsterRunStatus.CANCELED
    assert failed.status == "failed", failed
    [error] = failed.errors.data
    assert error.code == "pipeline_error" and run.run_id in error.message
    # The shards committed before the run was terminated are its output; every other request an error line.
    assert kept and {x["custom_id"] for x in out} == kept and len(out) == len(kept)
    assert err and {e["error"]["code"] for e in err} == {"batch_failed"}
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)
    assert failed.request_counts.model_dump() == {"total": len(rows), "completed": len(kept), "failed": len(err)}
    assert failed.usage.output_tokens == 40 * len(kept)  # billed: the answers only

    # The retry runs exactly the requests that never ran; merged with its parent, every request is answered.
    assert child.status == "completed" and child.request_counts.total == len(err)
    assert sorted(x["custom_id"] for x in child_out) == sorted(e["custom_id"] for e in err)
    merged = merged if isinstance(merged, str) else merged.text
    assert sorted(json.loads(x)["custom_id"] for x in merged.splitlines() if x.strip()) == sorted(
        r["custom_id"] for r in rows)


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_a_killed_engine_core_fails_the_shard_within_seconds_and_the_step_retries(tmp_path, data_dir, instance):
    # The in-process engine of this test process (batch_job's in-process executor), 3 shards of 4 requests of
    # 40 tokens each. Once a shard is committed, the engine core itself (not its model worker) is killed mid-shard.
    import threading

    from batch_dagster.defs.runner import run_batch
    from tests.helpers import make_defs, real_vllm, write_jsonl

    rows = [chat_request(f"k{i:02d}", f"Say the number {i} and name a color.", max_tokens=40, min_tokens=40,
                         temperature=0) for i in range(12)]
    killed: dict[str, float] = {}

    def kill_the_core_once_a_shard_is_committed() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            cores = [p for p in psutil.Process().children() if p.name().startswith("VLLM::EngineCor")]
            if cores and list(data_dir.glob("batches/*/results/shard-*.json")):
                [core] = cores
                killed["workers"] = [w.pid for w in core.children(recursive=True)]
                core.kill()
                killed["at"] = time.time()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_core_once_a_shard_is_committed, daemon=True)
    killer.start()
    defs = make_defs(data_dir, real_vllm(), shard_size=4)
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False, defs=defs,
                        instance=instance).to_dict()
    killer.join(1)
    assert "at" in killed, "the engine core was never killed"
    [run] = instance.get_runs()
    [retry] = step_events(instance, run.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY, "shard_results")
    # Noticed within seconds, as a crash of the engine (not hanging the step until someone kills the run).
    assert retry.timestamp - killed["at"] < 10, retry.timestamp - killed["at"]
    assert "EngineDeadError" in retry.event_log_entry.dagster_event.event_specific_data.error.to_string()
    # What the dead core left (its model worker) was killed, not left holding the model's memory.
    assert not [pid for pid in killed["workers"] if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    # The retry, on a new engine, finished the batch: every request once, nothing lost.
    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    out = read_jsonl(tmp_path / "out" / "output.jsonl")
    assert sorted(x["custom_id"] for x in out) == sorted(r["custom_id"] for r in rows)


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_run_whose_batch_dagster_run_was_killed_is_marked_failed_at_the_next_start(tmp_path):
    # `batch-dagster run` runs its batch in its own process (no launcher, no code server): killed -9 mid-run, it
    # leaves the run STARTED, in the run queue's limits, unless something notices that the process is gone.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import MODEL_CACHE, write_jsonl

    env = {**os.environ, "BATCH_DATA_DIR": str(tmp_path / "data"), "DAGSTER_HOME": str(tmp_path / "home"),
           "BATCH_MODEL_CACHE": str(MODEL_CACHE)}
    cli = str(Path(sys.executable).with_name("batch-dagster"))
    rows = [chat_request(f"q{i}", f"Say one word about {i}.", max_tokens=8) for i in range(4)]
    first = subprocess.Popen([cli, "run", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--out",
                              str(tmp_path / "out"), "--quiet"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)

    def started_runs() -> list:
        with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
            return instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))

    # Its run log is opened just before the run starts, once the instance's storage exists (not read before:
    # two processes creating it at once collide).
    deadline = time.time() + 120
    while not list((tmp_path / "data" / "logs").glob("run-*.log")) and time.time() < deadline:
        time.sleep(0.2)
    while not (runs := started_runs()) and time.time() < deadline:
        time.sleep(0.2)
    [run] = runs
    first.kill()  # SIGKILL: no exit handler runs
    first.wait(10)
    time.sleep(1)
    [still] = started_runs()
    assert still.run_id == run.run_id  # nothing else marks it failed

    # The next `batch-dagster run` (here an invalid file, which ends at validation) marks it failed first.
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    second = subprocess.run([cli, "run", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out2")], env=env,
                            capture_output=True, text=True, timeout=240)
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"run {run.run_id} was left STARTED" in second.stderr
    assert started_runs() == []
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        failed = instance.get_run_by_id(run.run_id)
        assert failed.status == dg.DagsterRunStatus.FAILURE
        [end] = [r.event_log_entry.dagster_event for r in instance.get_records_for_run(
            run.run_id, of_type={dg.DagsterEventType.RUN_FAILURE}).records]
        assert "`batch-dagster run` process that ran it is gone" in end.message
    # Its engine, if it had started one, went with it (engine/orphans.py).
    assert not [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("VLLM")
                and p.ppid() == 1 and p.pid > first.pid]
