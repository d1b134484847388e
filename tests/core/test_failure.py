"""A batch whose run failed for good: its committed shards kept, every other request an error line, each once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.columnar import custom_ids, validate_to_parquet, write_shards
from batch_dagster.batchfile.failure import (
    COST_LIMIT,
    LINE_REASON_CHARS,
    is_retryable,
    keep_finished,
    public,
    retryable_ids,
    stopped_ending,
)
from batch_dagster.batchfile.folder import BatchFolder, Manifest, Validation
from batch_dagster.batchfile.results import commit_shard, iter_lines
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.usage import load_price_table
from batch_dagster.settings import Settings
from batch_dagster.storage import LocalStorage

PRICES = load_price_table(Settings.from_env().prices_file)
CHAT_MODEL = "smollm2-135m-instruct"  # a model the price table prices (the core tier imports no test helpers)


def rows(n: int) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": c.CHAT,
             "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": f"question {i}"}]}}
            for i in range(n)]


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def validated(tmp_path, n: int = 6, shard_size: int | None = 2) -> BatchFolder:
    """A batch folder as the pipeline leaves it after validation (and, with `shard_size`, after sharding)."""
    folder = BatchFolder(LocalStorage(tmp_path / "store"), "batch_1")
    folder.put_input(write_jsonl(tmp_path / "in.jsonl", rows(n)))
    with folder.storage.writing(folder.requests_key) as out:
        report = validate_to_parquet(tmp_path / "in.jsonl", out)
    folder.write_validation(Validation(valid=True, total_requests=n, model=CHAT_MODEL, endpoint=c.CHAT,
                                       error_count=0, errors=[]))
    if shard_size is not None:
        with folder.storage.local_copy(folder.requests_key) as requests, \
                folder.storage.writing_folder(folder.shards_prefix) as shards:
            sizes = write_shards(requests, shards, shard_size)
        folder.write_manifest(Manifest(batch_id=folder.batch_id, endpoint=c.CHAT, model=CHAT_MODEL,
                                       total_requests=n, shard_size=shard_size, shard_count=len(sizes),
                                       shard_sizes=sizes))
    assert report.valid
    return folder


def answer(cid: str) -> dict:
    usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    return c.success_line(cid, {"object": "chat.completion", "model": CHAT_MODEL, "choices": [], "usage": usage})


def commit(folder: BatchFolder, index: int, lines_of) -> list[str]:
    with folder.storage.local_copy(folder.shard_key(index)) as shard:
        ids = custom_ids(shard)
    commit_shard(folder.storage, folder.results_prefix, index, [lines_of(cid) for cid in ids])
    return ids


def ended(folder: BatchFolder) -> tuple[list[dict], list[dict]]:
    return list(iter_lines(folder.storage, folder.output_key)), list(iter_lines(folder.storage, folder.error_key))


def test_the_committed_shards_are_kept_and_every_other_request_fails_once(tmp_path):
    folder = validated(tmp_path)
    kept = commit(folder, 0, answer)
    rejected = commit(folder, 1, lambda cid: c.request_error_line(cid, c.CONTEXT_LENGTH_EXCEEDED, "too long"))
    reason = "The pipeline failed in step shard_results: S3 said 503 " + "x" * 5000
    summary = keep_finished(folder, reason, PRICES)

    assert summary is not None and summary.status == "failed" and folder.summary() == summary
    out, err = ended(folder)
    assert [x["custom_id"] for x in out] == kept
    ids = Counter(x["custom_id"] for x in out + err)
    assert sorted(ids) == sorted(r["custom_id"] for r in rows(6)) and set(ids.values()) == {1}
    not_run = [e for e in err if e["custom_id"] not in rejected]
    assert len(not_run) == 2 and {e["error"]["code"] for e in not_run} == {c.BATCH_FAILED}
    message = not_run[0]["error"]["message"]
    assert message.startswith("The batch's run failed before this request ran: The pipeline failed in step")
    assert len(message) < LINE_REASON_CHARS + 100  # bounded, however long the failure was
    assert summary.request_counts.to_dict() == {"total": 6, "completed": 2, "failed": 4}
    assert summary.error_codes == {c.CONTEXT_LENGTH_EXCEEDED: 2, c.BATCH_FAILED: 2}
    # Billed: the two answers only.
    assert (summary.usage.input_tokens, summary.usage.output_tokens) == (20, 8)
    assert summary.cost.total_cost > 0 and summary.model == CHAT_MODEL
    [error] = summary.errors
    assert error.code == c.PIPELINE_ERROR and error.message.startswith("The pipeline failed") and len(error.message) < 3000
    assert folder.merged().status == "failed"
    # A retry runs the requests that never ran, never the ones that failed on their own (4xx).
    with open(folder.storage.uri(folder.error_key), "rb") as f:
        assert sorted(retryable_ids(f)) == sorted(e["custom_id"] for e in not_run)

    # Ended once: a second look keeps the same files.
    before = ended(folder)
    assert keep_finished(folder, "another failure", PRICES) == summary and ended(folder) == before


def test_a_run_that_failed_before_its_shards_were_cut_fails_every_request(tmp_path):
    folder = validated(tmp_path, n=3, shard_size=None)
    summary = keep_finished(folder, "the run was terminated", PRICES)
    assert summary is not None and summary.request_counts.to_dict() == {"total": 3, "completed": 0, "failed": 3}
    out, err = ended(folder)
    assert out == [] and sorted(e["custom_id"] for e in err) == ["r0", "r1", "r2"]
    assert summary.usage.total_tokens == 0 and summary.cost.total_cost == 0


@pytest.mark.parametrize("reason, code", [("cancelled", c.BATCH_CANCELLED), ("expired", c.BATCH_EXPIRED)])
def test_a_batch_asked_to_stop_ends_as_the_stop_would(tmp_path, reason, code):
    folder = validated(tmp_path, n=4)
    commit(folder, 0, answer)
    folder.request_stop(reason)  # then its run was terminated before it stopped by itself
    summary = keep_finished(folder, "The pipeline run was canceled", PRICES)
    assert summary is not None and summary.status == reason and summary.errors == []
    _, err = ended(folder)
    assert [e["error"]["code"] for e in err] == [code, code]


def test_nothing_is_kept_for_a_batch_that_was_not_validated(tmp_path):
    folder = BatchFolder(LocalStorage(tmp_path), "batch_1")
    assert keep_finished(folder, "the input could not be read", PRICES) is None
    folder.write_validation(Validation(valid=False, total_requests=2, model=None, endpoint=None, error_count=1,
                                       errors=[c.BatchError(c.INVALID_JSON, "bad", line=1)]))
    assert keep_finished(folder, "failed", PRICES) is None
    assert not folder.storage.exists(folder.output_key) and folder.summary() is None


def test_a_batch_its_cap_stopped_fails_with_its_code_and_its_requests_are_retryable():
    ending = stopped_ending(COST_LIMIT)
    assert ending.status == BatchStatus.FAILED and ending.code == c.COST_LIMIT_EXCEEDED
    assert [e.code for e in ending.errors] == [c.COST_LIMIT_EXCEEDED]
    line = c.not_run_line("a", ending.code, ending.message)
    assert is_retryable(line)  # not the request's fault: a retry (with budget left) runs it
    cancelled = stopped_ending(BatchStatus.CANCELLED)
    assert (cancelled.status, cancelled.code, cancelled.errors) == (BatchStatus.CANCELLED, c.BATCH_CANCELLED, [])
    assert stopped_ending(BatchStatus.EXPIRED).code == c.BATCH_EXPIRED


@pytest.mark.parametrize(("text", "shown"), [
    ("No server answered for 60s; last: http://10.0.0.5:8000/v1/chat/completions unreachable: ConnectError('x')",
     "No server answered for 60s; last: <internal address> unreachable: ConnectError('x')"),
    ("could not read s3://acme-batches/batches/b1/requests.jsonl: NoSuchKey",
     "could not read <internal address>: NoSuchKey"),
    ("[Errno 28] No space left on device: '/srv/batch-data/batches/b1/results/shard-00003.jsonl'",
     "[Errno 28] No space left on device: '<internal path>'"),
    # What a client sent or may read stays: an API route, fractions, relative paths.
    ("the request to /v1/chat/completions at line 3: 1/2 of its tokens, see ./docs/x", None),
])
def test_a_failure_is_told_to_clients_without_the_deployments_addresses_and_paths(text, shown):
    assert public(text) == (text if shown is None else shown)
