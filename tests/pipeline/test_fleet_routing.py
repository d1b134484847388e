"""Which engine a model's batches use: the fleet's model goes to its router, every other model runs offline."""

from __future__ import annotations

from batch_dagster.defs.resources.from_env import resources_from_env
from tests.helpers import CHAT_MODEL, EMBED_MODEL


def test_the_fleet_model_goes_to_the_fleet_and_other_models_run_offline(monkeypatch):
    monkeypatch.delenv("BATCH_FLEET_MODEL", raising=False)
    monkeypatch.delenv("BATCH_ENGINE_MODE", raising=False)
    monkeypatch.setenv("BATCH_FLEET_URL", "http://127.0.0.1:8200")
    vllm = resources_from_env()["vllm"]
    assert vllm.fleet_model == CHAT_MODEL  # the registry's first chat model, as make serve's fleet serves
    assert vllm.server_urls_for(CHAT_MODEL) == ["http://127.0.0.1:8200"]
    assert vllm.server_urls_for(EMBED_MODEL) is None
    monkeypatch.delenv("BATCH_FLEET_URL")
    assert resources_from_env()["vllm"].server_urls_for(CHAT_MODEL) is None  # no fleet running: offline
