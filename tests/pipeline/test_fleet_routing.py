"""Which engine a model's batches use: each model with a fleet goes to its router, every other model runs offline;
and where `make serve`'s fleets go: a block of ports each, their cores or GPUs one after the other."""

from __future__ import annotations

import socket
from contextlib import ExitStack

import pytest

from batch_dagster.defs.resources.from_env import resources_from_env
from batch_dagster.serve.__main__ import _fleets
from batch_dagster.serve.fleet import block_size, cores
from batch_dagster.settings import LOOPBACK, Settings
from tests.helpers import CHAT_MODEL, EMBED_MODEL, MODEL_CACHE


def test_each_fleet_model_goes_to_its_router_and_other_models_run_offline(monkeypatch):
    monkeypatch.delenv("BATCH_ENGINE_MODE", raising=False)
    monkeypatch.setenv("BATCH_FLEET_URLS", f"{CHAT_MODEL}=http://127.0.0.1:8200, {EMBED_MODEL}=http://127.0.0.1:8300/")
    vllm = resources_from_env(Settings.from_env())["vllm"].process_config_and_initialize()  # as a run sees it
    assert vllm.server_urls_for(CHAT_MODEL) == ["http://127.0.0.1:8200"]
    assert vllm.server_urls_for(EMBED_MODEL) == ["http://127.0.0.1:8300"]
    monkeypatch.setenv("BATCH_FLEET_URLS", f"{EMBED_MODEL}=http://127.0.0.1:8300")
    assert resources_from_env(Settings.from_env())["vllm"].server_urls_for(CHAT_MODEL) is None  # no fleet of its own: offline
    for bad in ("smollm", f"{CHAT_MODEL}=ftp://x", f"{CHAT_MODEL}=http://a,{CHAT_MODEL}=http://b"):
        monkeypatch.setenv("BATCH_FLEET_URLS", bad)
        with pytest.raises(ValueError, match="BATCH_FLEET_URLS"):
            Settings.from_env()


def ports(fleet) -> list[int]:
    return [fleet.port, *(int(u.rsplit(":", 1)[1]) for u in fleet.server_urls), fleet.metrics_port]


def test_two_serves_on_one_machine_start_their_fleets_on_different_free_ports(empty_env, monkeypatch):
    monkeypatch.setenv("BATCH_MODEL_CACHE", str(MODEL_CACHE))
    monkeypatch.setenv("BATCH_FLEET_REPLICAS", "2")
    monkeypatch.setenv("BATCH_FLEET_MODELS", f"{CHAT_MODEL},{EMBED_MODEL}")
    with ExitStack() as stack:
        first = _fleets(Settings.from_env(), None)  # BATCH_FLEET_PORT unset: serve's default
        taken = [p for fleet in first.fleets.values() for p in ports(fleet)]
        assert len(set(taken)) == len(taken) == 2 * block_size(2)  # the router's metrics port is the block's
        for port in taken:  # the first serve's routers, replicas and exporters listening
            s = stack.enter_context(socket.socket())
            s.bind((LOOPBACK, port))
            s.listen()
        second = _fleets(Settings.from_env(), None)
        again = [p for fleet in second.fleets.values() for p in ports(fleet)]
        assert len(set(again)) == len(again) and not set(taken) & set(again)
        for port in again:  # free: the second serve's fleets can take them
            stack.enter_context(socket.socket()).bind((LOOPBACK, port))
    monkeypatch.setenv("BATCH_FLEET_PORT", "9100")  # fixed ports, when asked for: one block after the other
    fleets = _fleets(Settings.from_env(), None).fleets
    assert [ports(f) for f in fleets.values()] == [[9100, 9101, 9102, 9103], [9104, 9105, 9106, 9107]]
    command = fleets[EMBED_MODEL].router_command()
    assert command[command.index("--prometheus-port") + 1] == "9107"


def test_fleets_take_gpus_one_after_the_other_and_refuse_when_none_is_left(empty_env, monkeypatch):
    from batch_dagster.serve.fleets import WarmFleets

    monkeypatch.setenv("BATCH_MODEL_CACHE", str(MODEL_CACHE))
    monkeypatch.setenv("BATCH_FLEET_REPLICAS", "1")
    settings = Settings.from_env()
    fleets = WarmFleets.plan(settings, [CHAT_MODEL, EMBED_MODEL], host=LOOPBACK, gpus=["0", "1", "2"])
    assert [p.gpus for f in fleets.fleets.values() for p in f.placements] == [("0",), ("1",)]
    assert fleets.spare_gpus == ["2"]
    with pytest.raises(ValueError, match=f"no GPU is left for the fleet of {EMBED_MODEL}"):
        WarmFleets.plan(settings, [CHAT_MODEL, EMBED_MODEL], host=LOOPBACK, gpus=["0"])
    on_cpu = WarmFleets.plan(settings, [CHAT_MODEL, EMBED_MODEL], host=LOOPBACK, gpus=[])  # a CPU host
    assert on_cpu.spare_gpus is None
    # The second fleet's replica is pinned to the core after the first's.
    assert [p.core for f in on_cpu.fleets.values() for p in f.placements] == [cores()[0], cores()[1 % len(cores())]]


def test_an_unknown_model_gets_no_fleet_and_serve_says_so(empty_env, monkeypatch, caplog):
    monkeypatch.setenv("BATCH_MODEL_CACHE", str(MODEL_CACHE))
    monkeypatch.setenv("BATCH_FLEET_MODELS", f"no-such-model,{EMBED_MODEL}")
    fleets = _fleets(Settings.from_env(), None)
    assert list(fleets.fleets) == [EMBED_MODEL]
    assert "BATCH_FLEET_MODELS names 'no-such-model', which is not in the registry" in caplog.text
    monkeypatch.setenv("BATCH_FLEET_MODELS", "no-such-model")
    assert _fleets(Settings.from_env(), None) is None
