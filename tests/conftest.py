"""Shared fixtures: a temporary data dir and Dagster instance, batch files, definitions to run."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from dagster_aws.s3 import S3Resource

from batch_dagster.assets.batch import lifecycle_assets
from batch_dagster.assets.checks import lifecycle_checks
from batch_dagster.jobs import batch_job
from batch_dagster.resources import BatchStorage, VLLMResource
from batch_dagster.settings import Settings

# Read before any test moves BATCH_DATA_DIR, so the prepared models are shared, not re-prepared.
MODEL_CACHE = Settings.from_env().model_cache_dir
CHAT_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"


def chat_request(custom_id: str, content: str, model: str = CHAT_MODEL, **params) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **params}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "data"
    monkeypatch.setenv("BATCH_DATA_DIR", str(d))
    return d


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def make_defs(data_dir: Path, vllm: VLLMResource) -> dg.Definitions:
    return dg.Definitions(
        assets=lifecycle_assets,
        asset_checks=lifecycle_checks,
        jobs=[batch_job],
        resources={"storage": BatchStorage(data_dir=str(data_dir)), "vllm": vllm, "s3": S3Resource()},
    )


def real_vllm(**kwargs) -> VLLMResource:
    return VLLMResource(models_file=str(Settings.from_env().models_file), model_cache_dir=str(MODEL_CACHE), **kwargs)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc=None) -> None:
    import time

    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM OpenAI-compatible server for the default chat model on loopback, for the session.

    Yields its base URL (without /v1). Started with the registry's settings, as `batch-dagster
    vllm-server` would start it.
    """
    import os
    import signal
    import subprocess

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
