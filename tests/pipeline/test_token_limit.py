"""The per-model enqueued-token limit: counted at validation, summed over the owner's unfinished batches."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder, Validation
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.db import Database, repo
from batch_dagster.db.batches import add_input_file, create_batch
from batch_dagster.defs.assets.batch import lifecycle
from batch_dagster.defs.assets.checks import lifecycle_checks
from batch_dagster.defs.jobs import batch_job
from batch_dagster.defs.resources import DatabaseResource, LazyS3Resource, PipelineConfig, StorageResource
from batch_dagster.defs.runner import run_batch
from batch_dagster.settings import default
from tests.helpers import CHAT_MODEL, FakeEngine, chat_request, count_words, fake_vllm, write_jsonl


@pytest.fixture(autouse=True)
def word_tokenizer(monkeypatch):
    """The limit's tokens counted one per word (tests/system/test_count_worker.py counts with vLLM's renderer)."""
    count_words(monkeypatch)


def defs_with_limit(data_dir: Path, limit: int, url: str) -> dg.Definitions:
    vllm = fake_vllm("token-limit", FakeEngine())
    return dg.Definitions(
        assets=lifecycle(default("BATCH_STEP_RETRY_DELAY_S")), asset_checks=lifecycle_checks, jobs=[batch_job],
        resources={"storage": StorageResource(data_dir=str(data_dir)), "vllm": vllm, "s3": LazyS3Resource(),
                   "database": DatabaseResource(url=url),
                   "pipeline": PipelineConfig(max_enqueued_tokens=limit)},
    )


def enqueue_other(store: Database, data_dir: Path, owner: str, tokens: int, status: str = "in_progress") -> str:
    """An unfinished batch of `owner` whose validation recorded `tokens` prompt tokens for the chat model."""
    storage = StorageResource(data_dir=str(data_dir)).open()
    with store.session() as session:
        file = add_input_file(session, owner=owner, file_id=repo.new_file_id(), filename="other.jsonl", size=0)
        storage.write_bytes(file.path, b"")
        row = create_batch(session, storage, BatchRequest(owner=owner, input_file_id=file.id, endpoint=c.CHAT), None)
        row.launched_at = row.created_at
        row.status = status
        session.commit()
        BatchFolder(storage, row.id).write_validation(Validation(
            valid=True, total_requests=1, model=CHAT_MODEL, endpoint=c.CHAT, error_count=0, errors=[],
            prompt_tokens=tokens))
        return row.id


@pytest.mark.parametrize(("other_owner", "other_status", "fails"), [
    (repo.ANONYMOUS, "in_progress", True),  # the same owner's unfinished batch counts
    ("someone-else", "in_progress", False),  # another owner's does not
    (repo.ANONYMOUS, "completed", False),  # nor a finished one
])
def test_a_batch_past_the_owners_enqueued_tokens_fails_with_token_limit_exceeded(
        tmp_path, data_dir, instance, other_owner, other_status, fails):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = Database(url)
    store.upgrade()
    with store.session() as session:
        repo.ensure_owners(session, [repo.ANONYMOUS, "someone-else"])
    enqueue_other(store, data_dir, other_owner, 30, other_status)
    # 4 requests of 5 words: 20 prompt tokens; with the other batch's 30, 50 > 40.
    rows = [chat_request(f"r{i}", "one two three four five") for i in range(4)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs_with_limit(data_dir, 40, url), instance=instance).to_dict()
    validation = BatchFolder(StorageResource(data_dir=str(data_dir)).open(), summary["batch_id"]).validation()
    assert validation.prompt_tokens == 20
    if fails:
        assert summary["status"] == "failed"
        [error] = summary["errors"]
        assert error["code"] == "token_limit_exceeded" and "Limit: 40 enqueued tokens" in error["message"]
        with store.session() as session:  # as the API shows it: errors.data carries the code
            batch = repo.get_batch(session, repo.ANONYMOUS, summary["batch_id"])
            assert batch.status == "failed" and batch.errors[0]["code"] == "token_limit_exceeded"
    else:
        assert summary["status"] == "completed"
    store.dispose()


def test_alone_a_batch_is_held_to_the_limit_too(tmp_path, data_dir, instance):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    rows = [chat_request(f"r{i}", "one two three four five") for i in range(4)]
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                        defs=defs_with_limit(data_dir, 19, url), instance=instance).to_dict()
    assert summary["status"] == "failed" and summary["errors"][0]["code"] == "token_limit_exceeded"
