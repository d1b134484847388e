"""A batch's folder: the one place that knows every file of a batch and reads and writes its documents.

The folder is the contract between the Dagster run, the API and the sensors. The data flows one
way through it, in the order of the listing below; each internal JSON document is a typed object.

    batches/<batch_id>/
      batch.json          BatchRequest: what the batch's creator asked (batchfile/options.py)
      source.json         Source: where a dropped file is fetched from, and its File's key
      table.json          TableDrop: a dropped table's name, what its sidecar asks, its rows refused before a request
      table.parquet       a dropped table's key columns, one row per row of the table
      deadline.json       Deadline: when the batch expires (no shard starts after it)
      stop.json           Stop: a request to stop before the next shard (cancel, expiry, cost cap)
      input.jsonl         the input file as uploaded
      validation.json     Validation: the validation report
      requests.parquet    the validated requests, one row per request
      shards/shard-NNNNN.parquet, shards/manifest.json (Manifest, written last)
      results/shard-NNNNN.{output.jsonl,errors.jsonl,json}  a shard's lines, and its summary (the commit marker)
      results/progress.json   Progress: the committed shards' totals and the live shard's count (after each marker)
      merged.json         Merged: counts and usage of the merged files
      output.jsonl, errors.jsonl
      summary.json        Summary: usage, cost and how the batch ran (written last)
      delivery/summary.json   what a dropped file's results carry beside them
    files/<file_id>.jsonl  uploaded, dropped and retry input files (beside the batch folders)
    answers/               answers kept for reuse (features/reuse.py)
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import orjson

from .contract import BatchError, RequestCounts
from .options import BatchRequest
from .status import BatchStatus
from .storage import Storage
from .usage import Cost, Usage

BATCHES = "batches"
FILES = "files"
ANSWERS = "answers"
INPUT = "input.jsonl"
OUTPUT = "output.jsonl"
ERRORS = "errors.jsonl"
SUMMARY = "summary.json"
REQUESTS = "requests.parquet"
ESTIMATE = "estimate.json"  # the valid batch's estimate, written by validation
RESULTS = "results"
IMAGES = "images"  # the images requests name by URL, fetched once per batch (a data URL per file)
_SHARD_SUMMARY = re.compile(r"^shard-(\d{5,})\.json$")


def shard_file(index: int) -> str:
    """The name of shard `index`'s requests file in the shards folder."""
    return f"shard-{index:05d}.parquet"


def shard_result_files(index: int) -> tuple[str, str, str]:
    """The names of shard `index`'s output lines, error lines and summary (its commit marker) in the results folder."""
    stem = f"shard-{index:05d}"
    return f"{stem}.output.jsonl", f"{stem}.errors.jsonl", f"{stem}.json"


def committed_index(name: str) -> int | None:
    """The shard index of a results-folder file that is a shard's commit marker, else None."""
    m = _SHARD_SUMMARY.match(name)
    return int(m.group(1)) if m else None


def file_key(file_id: str) -> str:
    """Where a File's bytes live in the storage (uploaded, dropped and retry input files)."""
    return f"{FILES}/{file_id}.jsonl"


def batch_ids(storage: Storage) -> list[str]:
    """The ids of the batches that have a folder in `storage`."""
    return [key.rsplit("/", 1)[-1] for key in storage.list_folders(BATCHES)]


D = TypeVar("D", bound="Document")


def _plain(value: Any) -> Any:
    """A field's JSON value: typed values (counts, usage, cost, errors) in their own JSON shape."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@dataclass
class Document:
    """An internal JSON document of the batch folder; unknown keys are ignored when read."""

    # How the typed fields are read back: field name -> the type's from_dict (a list field reads each item).
    TYPED: ClassVar[dict[str, Callable[[dict[str, Any]], Any]]] = {}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls: type[D], data: dict[str, Any]) -> D:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for name, read in cls.TYPED.items():
            if isinstance(values.get(name), list):
                values[name] = [read(v) for v in values[name]]
            elif isinstance(values.get(name), dict):
                values[name] = read(values[name])
        return cls(**values)


@dataclass
class Source(Document):
    """A dropped file's batch: batch_input fetches `uri` into its File (`file_path`: the File row's path) and
    copies it in."""

    uri: str
    file_path: str


@dataclass
class TableDrop(Document):
    """A dropped table's batch (batchfile/table.py): the table's file name, its sidecar's fields, its number of rows,
    and the rows that made no request (each a RowError's fields)."""

    filename: str
    sidecar: dict[str, Any]
    rows: int
    row_errors: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Deadline(Document):
    expires_at: float


@dataclass
class Stop(Document):
    reason: str  # BatchStatus.CANCELLED or EXPIRED, or failure.COST_LIMIT (failure.STOP_REASONS)
    at: float


@dataclass
class Validation(Document):
    """The validation report of the input file."""

    TYPED = {"errors": BatchError.from_dict}

    valid: bool
    total_requests: int
    model: str | None
    endpoint: str | None
    error_count: int
    errors: list[BatchError]
    validated_at: str = ""
    prompt_tokens: int | None = None  # counted with the model's tokenizer when an enqueued-token limit is set


@dataclass
class Manifest(Document):
    """The shard plan; written after every shard file, so its presence means the shards are complete."""

    batch_id: str
    endpoint: str
    model: str
    total_requests: int
    shard_size: int
    shard_count: int
    shard_sizes: list[int]


@dataclass
class Progress(Document):
    """How far inference is, in one small document: what the status sensor reads of a running batch, in place of
    listing and reading its shard markers.

    The inference step rewrites it as a shard goes on (`shard`, `done`: the live part, approximate) and right after
    each shard's commit marker (the committed totals), so it never counts a shard its marker does not hold; a
    process killed between the two leaves it behind, until the step's next attempt rewrites it at its start.
    `request_counts.total` is the batch's; its `completed` and `failed`, and `usage`, are the committed shards'.
    """

    TYPED = {"request_counts": RequestCounts.from_dict, "usage": Usage.from_dict}

    shard: int | None = None  # the shard being inferred; None between shards
    done: int = 0  # of its requests, those finished so far (not committed yet)
    shard_count: int | None = None  # the manifest's; None in a document written before the committed totals
    shards_committed: int = 0
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    usage: Usage = field(default_factory=Usage)
    committed_at: float | None = None  # when the last shard committed (epoch seconds)
    updated_at: float | None = None  # when this document was written (epoch seconds)

    @property
    def has_totals(self) -> bool:
        """Whether it holds the committed totals (not only the live part, as documents written before did)."""
        return self.shard_count is not None

    @property
    def all_committed(self) -> bool:
        return self.shard_count is not None and self.shards_committed >= self.shard_count

    def counts(self) -> RequestCounts:
        """The batch's request_counts so far: the committed shards', and the live shard's finished requests as
        completed (an approximation until it commits)."""
        counts = replace(self.request_counts)
        if self.shard is not None:
            counts.completed = min(counts.completed + self.done, counts.total - counts.failed)
        return counts


@dataclass
class Merged(Document):
    """The totals of the merged output and error files."""

    TYPED = {"request_counts": RequestCounts.from_dict, "usage": Usage.from_dict}

    status: str  # BatchStatus.COMPLETED, CANCELLED or EXPIRED; FAILED when its run failed for good
    request_counts: RequestCounts
    usage: Usage
    error_codes: dict[str, int]
    reused: int = 0  # of the completed requests, those answered from the answer store (their usage is not billed)


@dataclass
class Summary(Document):
    """The batch's end: usage, cost and the record of how it ran (written last)."""

    TYPED = {"request_counts": RequestCounts.from_dict, "usage": Usage.from_dict, "cost": Cost.from_dict,
             "errors": BatchError.from_dict}

    batch_id: str
    status: str
    endpoint: str
    model: str
    request_counts: RequestCounts
    usage: Usage
    cost: Cost
    error_codes: dict[str, int]
    inference_s: float
    output_tokens_per_s: float
    record: dict[str, Any]
    output_file: str
    error_file: str
    completed_at: str
    errors: list[BatchError] = field(default_factory=list)  # why a failed batch's run failed (its errors.data)
    reused: int = 0  # of the completed requests, those answered from the answer store (not in usage)


class BatchFolder:
    """The files of one batch in `storage`, under `batches/<batch_id>/`."""

    # Documents whose time of writing the API reports (status timestamps).
    VALIDATION, MANIFEST, MERGED = "validation.json", "shards/manifest.json", "merged.json"
    PROGRESS = f"{RESULTS}/progress.json"

    def __init__(self, storage: Storage, batch_id: str):
        self.storage, self.batch_id = storage, batch_id
        self.prefix = f"{BATCHES}/{batch_id}"

    def __repr__(self) -> str:
        return f"BatchFolder({self.storage!r}, {self.batch_id!r})"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # Objects the pipeline streams, by key (storage.open / local_copy / writing take these).
    @property
    def input_key(self) -> str:
        return self.key(INPUT)

    @property
    def requests_key(self) -> str:
        return self.key(REQUESTS)

    @property
    def shards_prefix(self) -> str:
        return self.key("shards")

    def shard_key(self, index: int) -> str:
        return f"{self.shards_prefix}/{shard_file(index)}"

    @property
    def results_prefix(self) -> str:
        return self.key(RESULTS)

    def image_key(self, url: str) -> str:
        """Where the image `url` names is kept once fetched, as its data URL (by the URL's hash: a URL is a client's
        value)."""
        return self.key(f"{IMAGES}/{hashlib.sha256(url.encode()).hexdigest()}")

    def image_record_key(self, url: str) -> str:
        """The kept image's record (its content's hash and size), written after it: an image without one is fetched
        again."""
        return self.image_key(url) + ".json"

    @property
    def images_spent_key(self) -> str:
        """What the batch's image fetches have spent so far of its budget (bytes and seconds)."""
        return self.key(f"{IMAGES}/spent.json")

    @property
    def output_key(self) -> str:
        return self.key(OUTPUT)

    @property
    def error_key(self) -> str:
        return self.key(ERRORS)

    @property
    def summary_key(self) -> str:
        return self.key(SUMMARY)

    # Documents.
    def _read(self, name: str, kind: type[D]) -> D | None:
        data = self.storage.read_bytes(self.key(name))
        return None if data is None else kind.from_dict(orjson.loads(data))

    def _write(self, name: str, doc: Document | BatchRequest) -> None:
        self.storage.write_bytes(self.key(name), orjson.dumps(doc.to_dict(), option=orjson.OPT_INDENT_2))

    def modified_at(self, name: str) -> int | None:
        """When a document of the folder was written (e.g. `validation.json`), in whole epoch seconds."""
        at = self.storage.modified_at(self.key(name))
        return None if at is None else int(at)

    def put_input(self, source: Path) -> None:
        """Copy an input file into the folder (the pipeline never reads outside it)."""
        self.storage.put_file(self.input_key, source)

    def copy_input(self, files: Storage, key: str) -> None:
        """Copy a stored File in as the input (within one store without passing through this process)."""
        if files is self.storage:
            self.storage.copy(key, self.input_key)
        else:
            with files.local_copy(key) as path:
                self.put_input(path)

    def has_input(self) -> bool:
        return self.storage.exists(self.key(INPUT))

    def batch_request(self) -> BatchRequest | None:
        """What the batch's creator asked (None: a folder with no batch.json, as a command-line batch's without a
        store)."""
        data = self.storage.read_bytes(self.key("batch.json"))
        return None if data is None else BatchRequest.from_dict(orjson.loads(data))

    def declare(self, request: BatchRequest) -> None:
        self._write("batch.json", request)

    def endpoint(self) -> str | None:
        """The batch's declared endpoint, or None (the first request's url then decides)."""
        request = self.batch_request()
        return request.endpoint if request else None

    def completion_window(self) -> str | None:
        """The window the batch was created with, which prices it (None: none; the price table's batch price)."""
        request = self.batch_request()
        return request.completion_window if request else None

    def source(self) -> Source | None:
        return self._read("source.json", Source)

    def set_source(self, uri: str, file_key: str) -> None:
        self._write("source.json", Source(uri, file_key))

    @property
    def table_key(self) -> str:
        """A dropped table's key columns (Parquet)."""
        return self.key("table.parquet")

    def table_drop(self) -> TableDrop | None:
        return self._read("table.json", TableDrop)

    def write_table_drop(self, drop: TableDrop) -> None:
        self._write("table.json", drop)

    def set_deadline(self, expires_at: float) -> None:
        """The time (epoch seconds) after which no new shard starts: the batch expires."""
        self._write("deadline.json", Deadline(expires_at))

    def deadline(self) -> Deadline | None:
        return self._read("deadline.json", Deadline)

    def request_stop(self, reason: str) -> None:
        """Ask a running batch to stop before its next shard (reason: "cancelled", "expired" or
        "cost_limit_exceeded")."""
        self._write("stop.json", Stop(reason, time.time()))

    def stop(self) -> Stop | None:
        """The stop requested (a cancel, or the expiry sensor's), if any."""
        return self._read("stop.json", Stop)

    def stop_reason(self) -> str | None:
        """Why the batch must stop now ("cancelled" or "expired"), or None to go on."""
        stop = self.stop()
        if stop is not None:
            return stop.reason
        deadline = self.deadline()
        if deadline is not None and time.time() >= deadline.expires_at:
            return BatchStatus.EXPIRED
        return None

    def validation(self) -> Validation | None:
        return self._read(self.VALIDATION, Validation)

    def write_validation(self, validation: Validation) -> None:
        self._write(self.VALIDATION, validation)

    def estimate(self) -> dict[str, Any] | None:
        """The valid batch's estimate as validation made it: a `batch.estimate` object (features/estimate.py)."""
        data = self.storage.read_bytes(self.key(ESTIMATE))
        return None if data is None else orjson.loads(data)

    def write_estimate(self, estimate: dict[str, Any]) -> None:
        self.storage.write_bytes(self.key(ESTIMATE), orjson.dumps(estimate, option=orjson.OPT_INDENT_2))

    def manifest(self) -> Manifest | None:
        return self._read(self.MANIFEST, Manifest)

    def write_manifest(self, manifest: Manifest) -> None:
        self._write(self.MANIFEST, manifest)

    def progress(self) -> Progress | None:
        return self._read(self.PROGRESS, Progress)

    def write_progress(self, progress: Progress) -> None:
        self._write(self.PROGRESS, progress)

    def merged(self) -> Merged | None:
        return self._read(self.MERGED, Merged)

    def write_merged(self, merged: Merged) -> None:
        self._write(self.MERGED, merged)

    def summary(self) -> Summary | None:
        return self._read(SUMMARY, Summary)

    def write_summary(self, summary: Summary) -> None:
        self._write(SUMMARY, summary)

    def write_delivery_summary(self, data: dict[str, Any]) -> str:
        """The summary.json that goes beside a dropped file's results (the batch as the API shows it); its key."""
        key = self.key(f"delivery/{SUMMARY}")
        self.storage.write_bytes(key, orjson.dumps(data, option=orjson.OPT_INDENT_2))
        return key

    def summary_modified_at(self) -> int | None:
        return self.modified_at(SUMMARY)

    def shard_committed_at(self, index: int) -> int | None:
        return self.modified_at(f"{RESULTS}/{shard_result_files(index)[2]}")

    def clear(self, keep: Collection[str] = ()) -> None:
        """Delete the folder's working files once its history is no longer kept: every object but summary.json
        (what the daily report prices a batch by) and the keys in `keep` (files the store still serves).
        Running it again deletes nothing more."""
        kept = {self.summary_key, *keep}
        for sub in self.storage.list_folders(self.prefix):
            self.storage.delete_folder(sub)
        for key in self.storage.list(self.prefix):
            if key not in kept:
                self.storage.delete(key)
