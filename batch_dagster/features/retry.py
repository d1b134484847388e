"""A retry batch: a child of an ended batch made of its retryable failures (failure.is_retryable: those that were
not the requests' own), and the results of both merged."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import orjson
import pyarrow.parquet as pq
from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.batchfile.contract import FAILED_LINES as FAILED
from batch_dagster.batchfile.contract import STRUCTURED_COUNTS, one_line
from batch_dagster.batchfile.failure import retryable_ids
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.options import MAX_METADATA_PAIRS, BatchRequest
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.structured import flagged_ids
from batch_dagster.batchfile.windows import CompletionWindows, Window
from batch_dagster.db import repo
from batch_dagster.db.batches import add_input_file, create_batch
from batch_dagster.db.models import BatchRecord, FileRecord
from batch_dagster.storage import file_location

# The metadata key a retry batch shows its parent under. Only create_retry writes it (the API refuses it in a
# client's metadata); what is followed is the batch's own parent_batch_id column, never the metadata.
PARENT = "parent_batch_id"
RESERVED_METADATA = (PARENT,)


def write_retry_input(requests_path: Path, ids: Collection[str], endpoint: str, dest: Path) -> int:
    """Write the original requests of `ids` (from the parent's validated requests) as a batch input file.

    Lines keep the parent's order; returns how many were written.
    """
    wanted = set(ids)
    source = pq.ParquetFile(requests_path)
    written = 0
    tmp = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for group in range(source.num_row_groups):
            table = source.read_row_group(group, columns=["custom_id", "body"])
            for cid, body in zip(table["custom_id"].to_pylist(), table["body"].to_pylist(), strict=True):
                if cid in wanted:
                    # The body is written as validated, byte for byte, so the child runs the same request.
                    out.write(one_line(b'{"custom_id":' + orjson.dumps(cid) + b',"method":"POST","url":'
                                       + orjson.dumps(endpoint) + b',"body":' + body.encode() + b"}") + b"\n")
                    written += 1
    tmp.replace(dest)
    return written


def custom_ids_of(*files: Iterable[bytes]) -> set[str]:
    """Every custom_id in these output or error files (their raw lines)."""
    ids: set[str] = set()
    for lines in files:
        ids.update(orjson.loads(raw)["custom_id"] for raw in lines if raw.strip())
    return ids


def merged_lines(parent_lines: Iterator[bytes], child_lines: Iterable[bytes],
                 child_ids: Collection[str]) -> Iterator[bytes]:
    """The parent's lines for requests the child did not run, then the child's: each custom_id once.

    Given the parent's and the child's output files this is the merged output; given their error
    files, the merged errors (the parent's retried failures are replaced by the child's outcome).
    """
    for raw in parent_lines:
        if raw.strip() and orjson.loads(raw)["custom_id"] not in child_ids:
            yield one_line(raw.rstrip(b"\n")) + b"\n"  # a file written before lines were escaped, escaped here
    for raw in child_lines:
        if raw.strip():
            yield one_line(raw.rstrip(b"\n")) + b"\n"


class CannotRetry(ValueError):
    """The batch has no request to retry (or has not ended yet); the message says which."""


def retry_window(parent: BatchRecord, windows: CompletionWindows) -> Window | None:
    """The window of a retry of `parent`: its parent's, from now (the longest offered when the operator no longer
    offers that one); none for a parent that had no deadline (the command line's)."""
    if parent.expires_at is None:
        return None
    return windows.window(parent.completion_window) if parent.completion_window in windows.lengths \
        else windows.default


def create_retry(session: Session, storage: Storage, parent: BatchRecord, *, windows: CompletionWindows,
                 admit: Callable[[Session, BatchRecord], None] | None = None,
                 max_priority: int | None = None, only: Collection[str] = (FAILED,)) -> BatchRecord:
    """A new batch of `parent`'s requests that `only` names (contract.RETRY_FILTERS: its retryable failed requests, by
    default), with their original bodies, same endpoint, model, options and window (retry_window). `admit`: the
    owner's limits (features/quotas.py batch_admission), checked before its row is added; a refusal leaves no File
    and no folder. `max_priority`: the highest priority the owner may ask now; a parent's above it (the bound was
    lowered since) is lowered to it."""
    if parent.status not in TERMINAL:
        raise CannotRetry(f"Batch {parent.id} is {parent.status}; only a batch that has ended can be retried.")
    ids = _retried_ids(session, storage, parent, set(only))
    folder = BatchFolder(storage, parent.id)
    input_file = add_input_file(session, owner=parent.owner, file_id=repo.new_file_id(),
                                filename=f"{parent.id}_retry.jsonl", size=0)
    batch_id = repo.new_batch_id()
    try:
        with storage.local_copy(folder.requests_key) as requests, storage.writing(input_file.path) as path:
            count = write_retry_input(requests, ids, parent.endpoint, path)
            input_file.bytes = path.stat().st_size
            assert count == len(ids), (count, len(ids))
            request = retry_request(parent, input_file.id, retry_window(parent, windows), max_priority)
            row = create_batch(session, storage, request, path, batch_id=batch_id, admit=admit)
            session.commit()
            return row
    except BaseException:
        session.rollback()
        storage.delete(input_file.path)
        storage.delete_folder(BatchFolder(storage, batch_id).prefix)
        raise


def _retried_ids(session: Session, storage: Storage, parent: BatchRecord, only: set[str]) -> list[str]:
    """The custom_ids a retry of `parent` runs: its error file's retryable lines (FAILED), its output file's lines
    marked as not following their schema (the STRUCTURED_COUNTS named); the reason when there are none."""
    # Each reason its own message: a batch whose files are gone is not one whose requests cannot be retried.
    wanted = [(FAILED, "error_file_id")] if FAILED in only else []
    wanted += [("structured", "output_file_id")] if only & set(STRUCTURED_COUNTS) else []
    ids: list[str] = []
    for kind, column in wanted:
        if getattr(parent, column) is None:
            raise CannotRetry(f"Batch {parent.id} ended with no {column.removesuffix('_id').replace('_', ' ')}, so it "
                              "has no request to retry.")
        file = _file(session, getattr(parent, column))
        requests_key = BatchFolder(storage, parent.id).requests_key
        if file is None or not _has_bytes(storage, file) or not storage.exists(requests_key):
            raise CannotRetry(f"Batch {parent.id} can no longer be retried: its files were deleted (retention, or its "
                              f"{column.removesuffix('_file_id')} file was deleted).")
        ids += retryable_ids(_lines(storage, file)) if kind == FAILED else flagged_ids(_lines(storage, file), only)
    if not ids:
        what = [f"{FAILED}: only requests that failed with a server error (5xx) or never ran (batch_expired, "
                "batch_cancelled, batch_failed) are retried, never 4xx"] if FAILED in only else []
        what += [f"{name}: no line is marked so" for name in STRUCTURED_COUNTS if name in only]
        raise CannotRetry(f"Batch {parent.id} has no request to retry ({'; '.join(what)}).")
    return ids


def retry_request(parent: BatchRecord, input_file_id: str, window: Window | None,
                  max_priority: int | None) -> BatchRequest:
    """What a retry of `parent` asks: its parent's request, on the retried requests' File, in `window`, its metadata
    naming the parent (after at most MAX_METADATA_PAIRS - 1 of the parent's own pairs), its priority no higher than
    `max_priority`."""
    asked = parent.request
    inherited = {k: v for k, v in (asked.metadata or {}).items() if k != PARENT}
    metadata = dict(list(inherited.items())[: MAX_METADATA_PAIRS - 1]) | {PARENT: parent.id}
    options = asked.options
    if max_priority is not None and options.priority > max_priority:
        options = options.model_copy(update={"priority": max_priority})
    return replace(asked, input_file_id=input_file_id, window=window, metadata=metadata, options=options,
                   parent_batch_id=parent.id)


def _has_bytes(storage: Storage, file: FileRecord) -> bool:
    files, key = file_location(storage, file.path)
    return files.exists(key)


def _lines(storage: Storage, file: FileRecord | None) -> Iterator[bytes]:
    """A File's lines, streamed; none when it has no bytes (any more)."""
    if file is None:
        return
    files, key = file_location(storage, file.path)
    if not files.exists(key):
        return
    with files.open(key) as f:
        yield from f


def _batch(session: Session, owner: str, batch_id: str | None) -> BatchRecord | None:
    """The owner's batch `batch_id`: a chain never reaches another owner's batch, whatever a row says."""
    if not batch_id:
        return None
    return session.scalar(select(BatchRecord).where(BatchRecord.owner == owner, BatchRecord.id == batch_id))


def _file(session: Session, file_id: str | None, owner: str | None = None) -> FileRecord | None:
    if not file_id:
        return None
    query = select(FileRecord).where(FileRecord.id == file_id)
    return session.scalar(query if owner is None else query.where(FileRecord.owner == owner))


def merged_content(session: Session, storage: Storage, file: FileRecord) -> Iterator[bytes] | None:
    """The lines of a retry batch's output (or error) file merged with its ancestors', or None if it has none.

    Each ancestor contributes the lines of the requests its descendants did not run again, so
    every custom_id of the original batch appears once across the merged output and error files.
    """
    batch = _batch(session, file.owner, file.batch_id)
    if batch is None or not batch.parent_batch_id:
        return None
    kind = "output_file_id" if batch.output_file_id == file.id else "error_file_id"
    return _merged(session, storage, batch, kind, seen=set())


def _merged(session: Session, storage: Storage, batch: BatchRecord, kind: str, seen: set[str]) -> Iterator[bytes]:
    """`batch`'s lines merged with its ancestors', each looked up under `batch`'s owner: a parent of another owner
    (or one already on the chain) ends the chain as a missing one would."""
    seen.add(batch.id)
    own = _file(session, getattr(batch, kind), batch.owner)
    if own is None:
        raise CannotRetry(f"Batch {batch.id} has no {kind.removesuffix('_id').replace('_', ' ')} yet.")
    files, key = file_location(storage, own.path)
    if not files.exists(key):
        # The file's id, never its storage URI: a client is not told where the store keeps its bytes.
        raise FileNotFoundError(f"the content of file {own.id} is gone")
    parent = _batch(session, batch.owner, batch.parent_batch_id)
    if parent is None or parent.id in seen:
        return _lines(storage, own)
    siblings = [_file(session, batch.output_file_id, batch.owner), _file(session, batch.error_file_id, batch.owner)]
    child_ids = custom_ids_of(*(_lines(storage, f) for f in siblings))
    return merged_lines(_merged(session, storage, parent, kind, seen), _lines(storage, own), child_ids)
