"""vLLM's prefix cache is kept per owner, on the real engine, in the run's process and on a vLLM server: every line
carries its owner's cache_salt, so a second owner sending the same long prompt gets no cached tokens (nor the time
and price they save), while the same owner's repeat does; a request's own cache_salt partitions its owner's part
further; owners the operator shares (BATCH_SHARED_OWNERS) share."""

from __future__ import annotations

import uuid

import pytest

from batch_dagster.defs.runner import run_batch
from batch_dagster.engine import counting
from tests.helpers import chat_request, database_url, make_defs, read_jsonl, real_vllm, write_jsonl

pytestmark = pytest.mark.engine
# About a thousand prompt tokens: many of the prefix cache's blocks.
LONG = "Summarize the following notes. " + " ".join(f"note{i} says item{i * 7 % 13}" for i in range(150))


def cached_tokens(tmp_path, data_dir, instance, vllm, key: str, name: str, salt: str | None = None,
                  **pipeline) -> int:
    """The cached prompt tokens the line of one batch of `key`'s owner reports (a command-line batch belongs to the
    store's intake key's owner), the request carrying its own cache_salt `salt` if given."""
    defs = make_defs(data_dir, vllm, database_url=database_url(data_dir), intake_api_key=key, **pipeline)
    rows = [chat_request("long", LONG, max_tokens=1, temperature=0, **({"cache_salt": salt} if salt else {}))]
    run_batch(write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / name, show_progress=False, defs=defs,
              instance=instance)
    [line] = read_jsonl(tmp_path / name / "output.jsonl")
    usage = line["response"]["body"]["usage"]
    assert usage["prompt_tokens"] > 600, usage
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("mode", ["offline", "server"])
def test_a_prefix_cached_for_one_owner_is_not_another_owners(tmp_path, data_dir, instance, mode, request):
    vllm = real_vllm(mode="server", server_urls=[request.getfixturevalue("vllm_server")]) if mode == "server" \
        else real_vllm()
    # Owners of their own in this session's engine (the server's is shared by the session's tests).
    a, b, c, d = (f"sk-{name}-{uuid.uuid4().hex}" for name in "abcd")
    assert cached_tokens(tmp_path, data_dir, instance, vllm, a, "a-first") == 0
    assert cached_tokens(tmp_path, data_dir, instance, vllm, b, "b") == 0  # A's prefix is not B's
    assert cached_tokens(tmp_path, data_dir, instance, vllm, a, "a-again") > 500  # it is A's
    # A's request with a cache_salt of its own: a part of A's cache apart from the rest, and its own again.
    assert cached_tokens(tmp_path, data_dir, instance, vllm, a, "a-own", salt="user-1") == 0
    assert cached_tokens(tmp_path, data_dir, instance, vllm, a, "a-own-again", salt="user-1") > 500
    assert cached_tokens(tmp_path, data_dir, instance, vllm, b, "b-own", salt="user-1") == 0  # B's is not A's
    # Owners the operator shares meet each other's prefixes (the intake keys have no name: every owner, `*`).
    assert cached_tokens(tmp_path, data_dir, instance, vllm, c, "c", shared_owners=["*"]) == 0
    assert cached_tokens(tmp_path, data_dir, instance, vllm, d, "d", shared_owners=["*"]) > 500
    if mode == "offline":  # each batch was counted by one worker, kept beside the engine running in this process
        worker = counting.shared_worker(vllm.models_file, vllm.model_cache_dir)
        assert worker.pid is not None
        counting.close_workers()
