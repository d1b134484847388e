"""The fault suite (issue #29): parts of a deployment failing while batches are queued, running and ending.

Each case runs `serve` (the API and the real Dagster daemon, with the project's dagster.yaml) on tests.daemon_defs'
fake engine, so what fails is the deployment around the engine, and checks "nothing lost" the same way: every batch
ends; each custom_id is in its output or error file exactly once; its request counts and usage are its lines'; and
the shards committed before the fault are neither rewritten nor sent to the engine again. What an operator sees and
does in each case: docs/faults.md#faults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import dagster as dg
import openai
import psutil
import pytest

from batch_dagster.batchfile.results import committed_shards, shard_keys
from batch_dagster.storage import LocalStorage
from batch_dagster.storage.s3 import S3Storage
from tests.daemon_defs import engine_calls
from tests.helpers import (
    Outage,
    Serve,
    chat_request,
    file_lines,
    new_database,
    step_events,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def batch_rows(name: str, n: int, words: int = 0) -> list[dict]:
    """n chat requests whose custom_ids start with `name` (a hold file of that name holds their engine calls); the
    fake engine's answers echo their `words` words."""
    return [chat_request(f"{name}-{i}", f"question {i} of batch {name} " + "word " * words, max_tokens=words + 8)
            for i in range(n)]


def held_rows(name: str, n: int, words: int = 0) -> list[dict]:
    """n requests in shards of 2, then `<name>-hold`, the least work: in the last shard, which a hold file of that
    name holds in the engine once the others are committed (shard.plan_shards runs the longest work first)."""
    return batch_rows(name, n, words) + [chat_request(f"{name}-hold", "last?", max_tokens=1)]


class Faults:
    """serve on the fake engine in `tmp_path`, each engine call logged, calls held by files in `hold`; the batch
    folders in the data folder, or on S3 when `s3` (a boto3 client of a versioned bucket) is given with its
    BATCH_STORAGE_URL in `env`."""

    def __init__(self, tmp_path: Path, s3=None, **env: str):
        self.tmp_path, self.hold, self.calls = tmp_path, tmp_path / "hold", tmp_path / "calls.jsonl"
        self.hold.mkdir(exist_ok=True)
        self.env = {"BATCH_SHARD_SIZE": "2", "BATCH_TEST_CALLS": str(self.calls), "BATCH_TEST_HOLD": str(self.hold),
                    "BATCH_OFFLINE_RUNS": "1", **env}
        self.s3 = s3
        if s3 is None:
            self.storage = LocalStorage(tmp_path / "data")
        else:
            url = urlparse(env["BATCH_STORAGE_URL"])
            self.storage = S3Storage(url.netloc, url.path, tmp_path / "scratch", client=s3)
        self.rows: dict[str, list[dict]] = {}

    def serve(self) -> Serve:
        return Serve(self.tmp_path, module="tests.daemon_defs", **self.env)

    def create(self, serve: Serve, name: str, rows: list[dict]):
        self.rows[(batch := serve.create_batch(rows, name=f"{name}.jsonl")).id] = rows
        return batch

    def held(self, serve: Serve, name: str, n: int, words: int = 0):
        """A batch of held_rows(name, n), once its first n / 2 shards are committed and its last is in the engine."""
        (self.hold / f"{name}-hold").touch()
        batch = self.create(serve, name, held_rows(name, n, words))
        wait_until(lambda: self.called(f"{name}-hold") and len(self.committed(batch)) == 3 * n // 2, 240, serve,
                   f"{name}'s last shard never reached the engine")
        return batch

    def release(self, name: str) -> None:
        (self.hold / f"{name}-hold").unlink()

    def committed(self, batch) -> dict[str, Any]:
        """Each file of the batch's committed shards (outputs, errors, commit markers), with what a rewrite changes:
        its inode and mtime on disk, its versions on S3."""
        results = f"batches/{batch.id}/results"
        keys = [key for i in sorted(committed_shards(self.storage, results)) for key in shard_keys(results, i)]
        if self.s3 is None:
            return {key: (p.stat().st_ino, p.stat().st_mtime_ns) for key in keys
                    if (p := self.storage.local_path(key))}
        return {key: self.versions(key) for key in keys}

    def versions(self, key: str) -> list[str]:
        """The versions of an object of the (versioned) bucket: written twice, even with the same bytes, it has two."""
        url = urlparse(self.storage.uri(key))
        found = self.s3.list_object_versions(Bucket=url.netloc, Prefix=url.path.lstrip("/")).get("Versions", [])
        return sorted(v["VersionId"] for v in found if v["Key"] == url.path.lstrip("/"))

    def called(self, prefix: str) -> bool:
        return any(cid.startswith(prefix) for call in engine_calls(self.calls) for cid in call["custom_ids"])

    def snapshot(self, *batches) -> tuple[dict, set[str], int]:
        """What the batches have committed (each file's stamp, and the custom_ids), and the engine calls so far."""
        stamps = {key: stamp for b in batches for key, stamp in self.committed(b).items()}
        cids = {x["custom_id"] for key in stamps if key.endswith(".jsonl")
                for x in map(json.loads, (self.storage.read_bytes(key) or b"").splitlines())}
        return stamps, cids, len(engine_calls(self.calls))

    def assert_kept(self, snapshot: tuple[dict, set[str], int], *batches) -> None:
        """The shards committed at `snapshot` were neither rewritten nor sent to the engine again."""
        stamps, cids, calls = snapshot
        now = {key: stamp for b in batches for key, stamp in self.committed(b).items()}
        assert {key: now.get(key) for key in stamps} == stamps
        again = {cid for call in engine_calls(self.calls)[calls:] for cid in call["custom_ids"]}
        assert not cids & again, sorted(cids & again)

    def ended(self, serve: Serve, batches, timeout_s: float = 300) -> dict[str, openai.types.Batch]:
        """Each batch once it is in a terminal status; the API may fail meanwhile (its database restarting)."""
        client, deadline, done = serve.client(), time.time() + timeout_s, {}
        while len(done) < len(batches):
            for b in batches:
                try:
                    if b.id not in done and (now := client.batches.retrieve(b.id)).status in TERMINAL:
                        done[b.id] = now
                except openai.APIError:
                    pass
            assert time.time() < deadline and serve.proc.poll() is None, f"{len(done)} ended\n{serve.logs()}"
            time.sleep(0.5)
        return done

    def assert_nothing_lost(self, serve: Serve, batch) -> tuple[list[dict], list[dict]]:
        """Each custom_id of the batch exactly once across its output and error files, counts and usage its lines'."""
        client = serve.client()
        out = file_lines(client, batch.output_file_id) if batch.output_file_id else []
        err = file_lines(client, batch.error_file_id) if batch.error_file_id else []
        rows = self.rows[batch.id]
        assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows), batch
        assert batch.request_counts.model_dump() == {"total": len(rows), "completed": len(out), "failed": len(err)}
        usage = [x["response"]["body"]["usage"] for x in out]
        billed = batch.usage.model_dump() if batch.usage else {"input_tokens": 0, "output_tokens": 0}
        assert billed["output_tokens"] == sum(u["completion_tokens"] for u in usage)
        assert billed["input_tokens"] == sum(u["prompt_tokens"] for u in usage)
        return out, err


def has_run(serve: Serve, batch) -> bool:
    with serve.instance() as instance:
        return bool(instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": batch.id})))


def test_daemon_killed_with_batches_in_every_state_then_serve_started_again(tmp_path):
    """The Dagster daemon killed with SIGKILL while one batch is done, one running (a shard in the engine), one
    queued behind it and one cancelled while queued: serve stops the rest and exits 1; started again, every batch
    ends as it would have, and the running one resumes without running its committed shards again."""
    faults = Faults(tmp_path)
    with faults.serve() as serve:
        done = faults.ended(serve, [faults.create(serve, "done", batch_rows("done", 3))], 120).popitem()[1]
        running = faults.held(serve, "run", 4)
        wait_until(lambda: serve.client().batches.retrieve(running.id).status == "in_progress", 240, serve,
                   "not shown in_progress")
        waiting = faults.create(serve, "wait", batch_rows("wait", 4))
        cancelled = faults.create(serve, "cxl", batch_rows("cxl", 2))
        wait_until(lambda: has_run(serve, waiting) and has_run(serve, cancelled), 240, serve, "nothing queued")
        serve.client().batches.cancel(cancelled.id)
        states = {b.id: serve.client().batches.retrieve(b.id).status for b in (done, running, waiting, cancelled)}

        [daemon] = [p for p in psutil.Process(serve.proc.pid).children() if "batch_dagster.defs.daemon" in p.cmdline()]
        daemon.send_signal(signal.SIGKILL)
        assert serve.proc.wait(120) == 1  # it stops the API and the run worker too, and says so
        assert "dagster-daemon exited unexpectedly; stopping the rest" in serve.logs()
    kept = faults.snapshot(running)
    assert states[done.id] == "completed" and states[running.id] == "in_progress"
    assert states[waiting.id] == "validating" and states[cancelled.id] in ("cancelling", "cancelled"), states

    faults.release("run")
    with faults.serve() as serve:
        ends = faults.ended(serve, [done, running, waiting, cancelled], 300)
        assert [ends[b.id].status for b in (done, running, waiting, cancelled)] == [
            "completed", "completed", "completed", "cancelled"], serve.logs()
        for batch in ends.values():
            faults.assert_nothing_lost(serve, batch)
        faults.assert_kept(kept, running)
        assert ends[done.id].output_file_id == done.output_file_id  # a finished batch is left as it was
    # The cancelled batch never reached the engine: every line of it is a batch_cancelled error.
    assert not faults.called("cxl")


def test_postgres_restarted_mid_run_loses_nothing(tmp_path, postgres):
    """The Dagster instance and the API's store on PostgreSQL 15, stopped as a crash stops it (immediate) while a
    batch's run is in its engine, and started 5 s later: the batch and those queued behind it end completed."""
    faults = Faults(tmp_path, DAGSTER_PG_URL=new_database(postgres.url),
                    BATCH_DATABASE_URL=new_database(postgres.url).replace("+psycopg2", "+psycopg"))
    with faults.serve() as serve:
        a = faults.held(serve, "a", 4)
        b, c = faults.create(serve, "b", batch_rows("b", 4)), faults.create(serve, "c", batch_rows("c", 3))
        kept = faults.snapshot(a)
        postgres.restart(down_s=5)
        faults.release("a")
        ends = faults.ended(serve, [a, b, c], 300)
        assert [ends[x.id].status for x in (a, b, c)] == ["completed"] * 3, serve.logs()
        for batch in ends.values():
            faults.assert_nothing_lost(serve, batch)
        faults.assert_kept(kept, a)
        assert serve.proc.poll() is None  # serve and its daemon rode it out: nothing exited


def step_retries(serve: Serve, batch, step_key: str) -> list[str]:
    """The errors for which `step_key` was retried in the batch's runs."""
    with serve.instance() as instance:
        return [r.event_log_entry.dagster_event.event_specific_data.error.to_string()
                for run in instance.get_runs(dg.RunsFilter(tags={"dagster/partition": batch.id}))
                for r in step_events(instance, run.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY, step_key)]


def fill(folder: Path, leave: int) -> Path:
    """A file that fills the disk of `folder` but for `leave` bytes."""
    filler = folder / "filler"
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * (free - leave))
    return filler


def test_disk_full_during_the_merge_then_freed_the_batch_completes(tmp_path):
    """The data folder on a 32 MB tmpfs, filled while a batch's last shard is in the engine, so the shard still
    commits but the merge (the output file is larger) finds no space; freed once the merge has failed, the merge's
    next retry (batch_output_files retries for about 2 minutes) writes the files and the batch completes."""
    data = tmp_path / "data"
    data.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(data)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"no tmpfs for the data folder (mounting one needs root): {mounted.stderr.decode()}")
    try:
        faults = Faults(tmp_path)
        with faults.serve() as serve:
            a = faults.held(serve, "a", 40, words=300)  # answers of about 2 KB: the output file about 80 KB
            kept = faults.snapshot(a)
            filler = fill(data, leave=32 << 10)
            faults.release("a")
            [error, *_] = wait_until(lambda: step_retries(serve, a, "batch_output_files"), 240, serve,
                                     "the merge never failed")
            filler.unlink()
            [end] = faults.ended(serve, [a], 300).values()
            assert end.status == "completed", serve.logs()
            faults.assert_nothing_lost(serve, end)
            faults.assert_kept(kept, a)
        assert "No space left on device" in error, error
    finally:
        subprocess.run(["umount", "--lazy", str(data)], capture_output=True)


def test_s3_unreachable_for_60_s_during_a_commit_and_during_the_merge_the_batches_complete(tmp_path, s3_endpoint):
    """The batch folders and uploads on S3 (moto, behind a proxy the test takes down): the store refuses every
    connection for 60 s from the moment a batch's last shard leaves the engine (its progress and its commit fail),
    and again for 60 s from the first write of another batch's merged output file. The inference step and the merge
    retry for about 2 minutes (inference.step_retries), so both batches complete, their committed shards kept."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="faults")
    s3.put_bucket_versioning(Bucket="faults", VersioningConfiguration={"Status": "Enabled"})
    store = Outage(int(s3_endpoint.rsplit(":", 1)[1]))
    faults = Faults(tmp_path, s3=s3, BATCH_STORAGE_URL="s3://faults/team", AWS_ENDPOINT_URL=store.url,
                    AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    with faults.serve() as serve:
        a = faults.held(serve, "a", 4)
        b = faults.create(serve, "b", batch_rows("b", 4))
        kept = faults.snapshot(a)
        store.down()
        faults.release("a")
        time.sleep(60)
        # b's run comes after a's (one offline run at a time): the store goes away again at its merge.
        store.down_at(rb"PUT /faults/team/batches/" + b.id.encode() + rb"/output\.jsonl")
        store.up()
        [end_a] = faults.ended(serve, [a], 300).values()
        assert store.tripped.wait(240), serve.logs()
        time.sleep(60)
        store.up()
        [end_b] = faults.ended(serve, [b], 300).values()
        assert [end_a.status, end_b.status] == ["completed", "completed"], serve.logs()
        for batch in (end_a, end_b):
            faults.assert_nothing_lost(serve, batch)
        faults.assert_kept(kept, a)
        assert serve.proc.poll() is None
    commit, merge = step_retries(serve, a, "shard_results"), step_retries(serve, b, "batch_output_files")
    assert commit and merge, (commit, merge)
    assert all("Could not connect to the endpoint URL" in e for e in commit + merge), commit + merge
