"""`make serve`'s warm fleets on one machine, with real vllm-routers in front of stand-in replicas (no engine): each
fleet on a block of ports of its own, its router's metrics exporter included (two routers no longer collide on
29000); a fleet that fails to start is left out and said so, the others run; a fleet idle past BATCH_FLEET_IDLE_S
stops its replicas (the router stays) and starts them again on its model's next batch, its states and start in the
store for the ETA."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import httpx
import psutil
import pytest

from batch_dagster.db import BatchRecord, Database, FileRecord, repo
from batch_dagster.db.fleets import start_delays
from batch_dagster.db.models import FleetRecord
from batch_dagster.serve.fleet import Fleet
from batch_dagster.serve.fleets import WarmFleets
from batch_dagster.settings import LOOPBACK, Settings

pytestmark = pytest.mark.timeout(180)


def stand_in_fleets(tmp_path):
    """A factory of fleets whose replicas are tests/fake_replica.py; the model `broken`'s exit at once."""

    def make(settings, model, replicas, port, policy, host, *, gpus=None, first_core=0) -> Fleet:
        fail = ["env", "FAKE_REPLICA_FAIL=1"] if model == "broken" else []
        return Fleet(model, replicas, port, lambda p: [*fail, sys.executable, "-m", "tests.fake_replica", str(p), model],
                     policy, host, log_dir=tmp_path / "logs" / model, gpus=gpus, first_core=first_core)

    return make


def add_batch(store: Database, model: str, batch_id: str) -> None:
    with store.session() as session:
        repo.ensure_owners(session, ["o"])
        if session.get(FileRecord, 1) is None:
            session.add(FileRecord(pk=1, id="f1", owner="o", bytes=1, created_at=1, filename="in.jsonl",
                                   purpose="batch", path="files/f1"))
        session.add(BatchRecord(id=batch_id, owner="o", endpoint="/v1/embeddings", input_file_id="f1",
                                completion_window="24h", status="in_progress", created_at=1, model=model))
        session.commit()


def states(store: Database) -> dict[str, str]:
    with store.session() as session:
        return {f.model: f.state for f in session.query(FleetRecord)}


def tick_until(fleets: WarmFleets, done, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        fleets.tick()
        time.sleep(0.2)


def test_fleets_share_a_machine_sleep_when_idle_and_wake_for_their_models_next_batch(tmp_path, caplog):
    store = Database(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    settings = replace(Settings.from_env(), fleet_replicas=1, fleet_port=0, fleet_idle_s=1.0)
    fleets = WarmFleets.plan(settings, ["chat", "embed", "broken"], host=LOOPBACK, store=store, gpus=[],
                             make=stand_in_fleets(tmp_path))
    add_batch(store, "chat", "batch_chat")  # chat has work: it stays warm
    try:
        fleets.start(should_stop=lambda: False)
        assert set(fleets.urls()) == {"chat", "embed"}  # the broken one is left out, the others run
        assert "the fleet of broken did not start" in caplog.text
        assert states(store) == {"chat": "warm", "embed": "warm", "broken": "failed"}
        chat, embed = fleets.fleets["chat"], fleets.fleets["embed"]
        assert len({chat.metrics_port, embed.metrics_port, 29000}) == 3
        for model, fleet in fleets.fleets.items():
            answer = httpx.post(f"{fleet.url}/v1/embeddings", json={"model": model, "input": "x"}, timeout=10)
            assert answer.json()["model"] == model  # each router in front of its own replicas
            assert "vllm_router_" in httpx.get(f"http://{LOOPBACK}:{fleet.metrics_port}/metrics", timeout=5).text

        replica = psutil.Process(embed.children.procs["vllm-0"].pid)
        tick_until(fleets, lambda: embed.asleep)  # no batch of embed for idle_s: its replicas stop
        assert not chat.asleep and states(store) == {"chat": "warm", "embed": "asleep", "broken": "failed"}
        replica.wait(10)
        assert embed.children.procs["router"].poll() is None  # the router stays on its port
        with store.session() as session:
            delays = start_delays(session, time.time())
        assert set(delays) == {"embed"} and 0 < delays["embed"] < 60  # its next batch waits its last start

        add_batch(store, "embed", "batch_embed")
        tick_until(fleets, lambda: states(store)["embed"] == "warm")
        deadline = time.monotonic() + 30  # the router takes the replica back at its next health check
        while (answer := httpx.post(f"{embed.url}/v1/embeddings", json={"input": "x"}, timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.5)
        assert answer.json()["model"] == "embed"
    finally:
        processes = [p for f in fleets.fleets.values() for p in f.children.procs.values()]
        fleets.stop()
    assert all(p.poll() is not None for p in processes)
    assert states(store) == {}  # serve stopped: no fleet for the ETA to wait for
    store.dispose()
