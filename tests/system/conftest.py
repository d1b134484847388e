"""Fixtures of the system tier: a real vLLM server, shared by the whole session."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.helpers import CHAT_MODEL, free_port, real_vllm, wait_http


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM OpenAI-compatible server for the default chat model on loopback, for the session.

    Yields its base URL (without /v1). Started with the registry's settings, as `batch-dagster
    vllm-server` would start it.
    """
    from batch_dagster.engine.server import server_command

    vllm = real_vllm()
    spec = vllm.spec(CHAT_MODEL)
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm-server") / "server.log", "w")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(server_command(spec, vllm.model_path(spec), "127.0.0.1", port), stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", 300, proc)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
