"""Which engine a model's batches use: the fleet's model goes to its router, every other model runs offline."""

from __future__ import annotations

from batch_dagster.defs.resources.from_env import resources_from_env
from tests.helpers import CHAT_MODEL, EMBED_MODEL


def test_the_fleet_model_goes_to_the_fleet_and_other_models_run_offline(monkeypatch):
    monkeypatch.delenv("BATCH_FLEET_MODEL", raising=False)
    monkeypatch.delenv("BATCH_ENGINE_MODE", raising=False)
    monkeypatch.setenv("BATCH_FLEET_URL", "http://127.0.0.1:8200")
    vllm = resources_from_env()["vllm"].process_config_and_initialize()  # as a run sees it (BATCH_FLEET_URL resolved)
    assert vllm.fleet_model == CHAT_MODEL  # the registry's first chat model, as make serve's fleet serves
    assert vllm.server_urls_for(CHAT_MODEL) == ["http://127.0.0.1:8200"]
    assert vllm.server_urls_for(EMBED_MODEL) is None
    monkeypatch.delenv("BATCH_FLEET_URL")
    assert resources_from_env()["vllm"].process_config_and_initialize().server_urls_for(CHAT_MODEL) is None  # no fleet running: offline


def test_two_serves_on_one_machine_start_their_fleets_on_different_free_ports(empty_env, monkeypatch):
    import socket
    from contextlib import ExitStack

    from batch_dagster.serve.__main__ import _fleet
    from batch_dagster.settings import LOOPBACK, Settings
    from tests.helpers import MODEL_CACHE

    monkeypatch.setenv("BATCH_MODEL_CACHE", str(MODEL_CACHE))
    monkeypatch.setenv("BATCH_FLEET_REPLICAS", "2")

    def ports(fleet) -> list[int]:
        return [fleet.port, *(int(u.rsplit(":", 1)[1]) for u in fleet.server_urls)]

    with ExitStack() as stack:
        first = _fleet(Settings.from_env())  # BATCH_FLEET_PORT unset: serve's default
        for port in ports(first):  # the first serve's router and replicas listening
            s = stack.enter_context(socket.socket())
            s.bind((LOOPBACK, port))
            s.listen()
        second = _fleet(Settings.from_env())
        assert len(set(ports(first))) == len(set(ports(second))) == 3
        assert not set(ports(first)) & set(ports(second))
        for port in ports(second):  # free: the second serve's fleet can take them
            stack.enter_context(socket.socket()).bind((LOOPBACK, port))
        assert second.url == f"http://{LOOPBACK}:{second.port}"
    monkeypatch.setenv("BATCH_FLEET_PORT", "9100")  # a fixed port, when one is asked for
    assert ports(_fleet(Settings.from_env())) == [9100, 9101, 9102]
