"""The run's summary names the engine that ran the batch and the time this run spent starting it."""

from __future__ import annotations

import time

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.registry import ModelSpec
from batch_dagster.defs.runner import run_batch
from batch_dagster.engine import offline
from batch_dagster.storage import LocalStorage
from tests.helpers import CHAT_MODEL, FakeEngine, FakeVLLM, chat_request, fake_vllm, make_defs, write_jsonl

UNPAID: list[float] = []  # the engine starts StartingVLLM still has to report


class StartingVLLM(FakeVLLM):
    """The fake engine, as if it took 1.25 s to start before the first shard it ran."""

    def engine_start_s(self, model: str, since: float) -> float:
        return UNPAID.pop() if UNPAID else 0.0  # later shards reuse the started engine


def test_an_engine_started_by_the_run_is_named_with_its_start_time(tmp_path, data_dir, instance):
    vllm = fake_vllm("starting", FakeEngine(), cls=StartingVLLM)
    UNPAID[:] = [1.25]
    rows = [chat_request(f"r{i}", f"q {i}") for i in range(3)]
    run = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                    defs=make_defs(data_dir, vllm, shard_size=1), instance=instance)
    assert run.batch.engine is not None
    assert run.to_dict()["engine"] == {"mode": "fake", "url": None, "start_s": 1.25}  # paid once, by shard 0
    assert set(run.to_dict()) == {"batch_id", "status", "model", "endpoint", "request_counts", "usage", "cost",
                                  "inference_s", "output_tokens_per_s", "engine", "run_id", "output_file",
                                  "error_file", "duration_s"}  # the CLI's --json keys
    assert run.batch.engine.describe() == "the fake engine in this process, started in 1.2 s"
    summary = BatchFolder(LocalStorage(data_dir), run.batch.batch_id).summary()
    assert summary is not None and summary.record["engine_start_s"] == 1.25


def test_a_running_fleet_is_named_and_starts_nothing(tmp_path, data_dir, instance):
    vllm = fake_vllm("fleet", FakeEngine(), fleet_urls={CHAT_MODEL: "http://127.0.0.1:8200"})
    run = run_batch(write_jsonl(tmp_path / "in.jsonl", [chat_request("a", "hi")]), tmp_path / "out",
                    show_progress=False, defs=make_defs(data_dir, vllm), instance=instance)
    assert run.to_dict()["engine"] == {"mode": "server", "url": "http://127.0.0.1:8200", "start_s": 0.0}
    assert run.batch.engine is not None
    assert run.batch.engine.describe() == "the vLLM server(s) at http://127.0.0.1:8200 (no engine start)"


def test_an_offline_engine_counts_its_start_only_for_the_shard_that_started_it(monkeypatch):
    engine = offline.OfflineEngine(ModelSpec(name="m", source="/w"), "/w")
    engine.start_s, engine.started_at = 27.3, time.perf_counter()
    monkeypatch.setitem(offline._ENGINES, "m", engine)
    assert offline.start_seconds("m", since=engine.started_at - 30) == 27.3  # built during this shard
    assert offline.start_seconds("m", since=time.perf_counter()) == 0.0  # reused by a later shard or run
    assert offline.start_seconds("other", since=0.0) == 0.0
