"""Per-key limits (issue #18): batches not yet ended and bytes of files stored, each answered past its limit with a
429 in OpenAI's shape; and keys with names (`name:key`) are the same owners as the bare keys they name."""

from __future__ import annotations

import openai
import pytest

from batch_dagster.db import Database, keys, repo
from tests.helpers import KEY_A, KEY_B, rows, upload

CHAT = "/v1/chat/completions"


def create(client, file_id: str):
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")


def test_a_key_past_its_unfinished_batches_gets_a_429_and_others_do_not(start_service, tmp_path):
    service = start_service(worker=False, key_max_active_batches=2)
    a, b = service.client(KEY_A), service.client(KEY_B)
    file_a = upload(a, tmp_path / "a.jsonl", rows(2))
    first, _ = create(a, file_a), create(a, file_a)
    with pytest.raises(openai.RateLimitError) as refused:
        create(a, file_a)
    error = refused.value.body
    assert (error["code"], error["type"]) == ("batch_limit_exceeded", "rate_limit_exceeded")
    assert "BATCH_KEY_MAX_ACTIVE_BATCHES" in error["message"]
    create(b, upload(b, tmp_path / "b.jsonl", rows(2)))  # the limit is per key
    a.batches.cancel(first.id)  # cancelling is not ended yet: still counted
    with pytest.raises(openai.RateLimitError):
        create(a, file_a)
    with Database(service.config.database_url).session() as session:  # as the status sensor ends it
        row = repo.get_batch(session, repo.owner_of_key(KEY_A), first.id)
        assert row is not None
        row.status = "cancelled"
        session.commit()
    assert create(a, file_a).status == "validating"  # one ended: room for one more


def test_a_key_past_its_stored_bytes_gets_a_429_until_it_deletes(start_service, tmp_path):
    service = start_service(worker=False, key_max_stored_bytes=3000)
    a, b = service.client(KEY_A), service.client(KEY_B)
    first = upload(a, tmp_path / "a1.jsonl", rows(10))
    size = a.files.retrieve(first).bytes
    assert 1500 < size <= 3000, size  # two of these do not fit
    with pytest.raises(openai.RateLimitError) as refused:
        upload(a, tmp_path / "a2.jsonl", rows(10))
    assert refused.value.body["code"] == "storage_limit_exceeded"
    assert [f.id for f in a.files.list()] == [first]  # the refused upload left nothing
    upload(b, tmp_path / "b.jsonl", rows(10))  # per key
    a.files.delete(first)
    upload(a, tmp_path / "a3.jsonl", rows(10))


def test_a_named_key_is_the_owner_of_the_bare_key_it_names(start_service, tmp_path):
    """Naming a key (BATCH_API_KEYS=name:key) changes how the UI shows its owner, not which rows are its."""
    service = start_service(worker=False, api_keys=(KEY_A,))
    file_id = upload(service.client(KEY_A), tmp_path / "a.jsonl", rows(2))
    named = start_service(worker=False, api_keys=(f"alice:{KEY_A}", KEY_B))
    assert named.client(KEY_A).files.retrieve(file_id).id == file_id
    with pytest.raises(openai.AuthenticationError):
        named.client(f"alice:{KEY_A}").files.list()  # the name is no part of the key
    with Database(named.config.database_url).session() as session:
        assert keys.authenticate(session, KEY_A) == keys.Caller(repo.owner_of_key(KEY_A), "alice")
        assert keys.authenticate(session, KEY_B).owner == repo.owner_of_key(KEY_B)
