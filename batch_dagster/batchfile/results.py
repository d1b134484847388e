"""Shard results and the merged output: atomic per-shard commits, then one output and one error file.

A shard commits three objects under the results folder: its output lines, its error lines and its
marker (CommittedShard: its counts and usage). Each is written atomically and the marker last, so its
presence is the commit (on S3 too: a marker never exists without its lines): a re-run skips every shard
that has one and redoes the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from . import contract as c
from .contract import RequestCounts
from .folder import Progress, committed_index, shard_result_files
from .storage import Storage
from .structured import Expected, mark
from .usage import Usage

__all__ = ["RequestCounts"]  # defined with the contract; imported from here too


@dataclass
class CommittedShard:
    """What one committed shard holds."""

    index: int
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    usage: Usage = field(default_factory=Usage)
    error_codes: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    engine_start_s: float = 0.0  # of duration_s, the engine's start when this shard started it
    reused: int = 0  # of its completed requests, those whose answer came from the answer store (not billed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "request_counts": self.request_counts.to_dict(),
            "usage": self.usage.to_dict(),
            "error_codes": self.error_codes,
            "duration_s": self.duration_s,
            "engine_start_s": self.engine_start_s,
            "reused": self.reused,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommittedShard:
        return cls(
            index=d["index"],
            request_counts=RequestCounts.from_dict(d["request_counts"]),
            usage=Usage.from_dict(d["usage"]),
            error_codes=dict(d.get("error_codes", {})),
            duration_s=d.get("duration_s", 0.0),
            engine_start_s=d.get("engine_start_s", 0.0),
            reused=d.get("reused", 0),
        )


def error_code(line: dict[str, Any]) -> str:
    """The code of an error line, whichever of the two error shapes it has."""
    if line.get("error"):
        return line["error"].get("code") or "unknown"
    return (((line.get("response") or {}).get("body") or {}).get("error") or {}).get("code") or "unknown"


def shard_keys(results_prefix: str, index: int) -> tuple[str, str, str]:
    """(output lines, error lines, commit marker) of shard `index`."""
    output, errors, marker = shard_result_files(index)
    return f"{results_prefix}/{output}", f"{results_prefix}/{errors}", f"{results_prefix}/{marker}"


def commit_shard(
    storage: Storage, results_prefix: str, index: int, lines: Iterable[dict[str, Any]], duration_s: float = 0.0,
    engine_start_s: float = 0.0, structured: Mapping[str, Expected] | None = None,
) -> CommittedShard:
    """Split a shard's lines into output and error lines and commit them atomically. `structured`: what the answers
    of the requests that asked for structure must be (structured.expectations): an answer that is not is marked with
    its first violation and counted."""
    structured = structured or {}
    marker = CommittedShard(index=index, duration_s=round(duration_s, 3), engine_start_s=round(engine_start_s, 3))
    ok, failed = bytearray(), bytearray()
    for line in lines:
        marker.request_counts.total += 1
        if c.is_success(line):
            marker.request_counts.completed += 1
            body = line["response"]["body"]
            if c.is_billed(line):
                marker.usage.add_body(body)
            else:
                marker.reused += 1
            expected = structured.get(line["custom_id"])
            if expected is not None and (count := mark(line, expected)) is not None:
                setattr(marker.request_counts, count, getattr(marker.request_counts, count) + 1)
            ok += c.jsonl_line(line)
        else:
            marker.request_counts.failed += 1
            code = error_code(line)
            marker.error_codes[code] = marker.error_codes.get(code, 0) + 1
            failed += c.jsonl_line(line)
    out_key, err_key, marker_key = shard_keys(results_prefix, index)
    storage.write_bytes(out_key, bytes(ok))
    storage.write_bytes(err_key, bytes(failed))
    storage.write_bytes(marker_key, orjson.dumps(marker.to_dict()))  # the commit marker, last
    return marker


def committed_shards(storage: Storage, results_prefix: str) -> dict[int, CommittedShard]:
    """Summaries of the shards already committed, by index."""
    found = {}
    for key in storage.list(results_prefix):
        index = committed_index(key.rsplit("/", 1)[-1])
        data = storage.read_bytes(key) if index is not None else None
        if index is not None and data is not None:
            found[index] = CommittedShard.from_dict(orjson.loads(data))
    return found


def progress_of(shards: dict[int, CommittedShard], total_requests: int, shard_count: int | None,
                committed_at: float | None = None) -> Progress:
    """The progress document of a batch whose committed shards are `shards`, between two shards (nothing live);
    `committed_at`: when the last of them committed (default: now, as written right after its marker)."""
    counts, usage = RequestCounts(total=total_requests), Usage()
    for shard in shards.values():
        counts.completed += shard.request_counts.completed
        counts.failed += shard.request_counts.failed
        counts.incomplete_structured += shard.request_counts.incomplete_structured
        counts.invalid_structured += shard.request_counts.invalid_structured
        usage += shard.usage
    at = time.time()
    return Progress(shard_count=shard_count, shards_committed=len(shards), request_counts=counts, usage=usage,
                    committed_at=committed_at if committed_at is not None or not shards else at, updated_at=at)


def committed_output(storage: Storage, results_prefix: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The output lines of the shards committed so far, in shard order: the lines the merged output file holds
    of them (each custom_id once, since a shard is committed once)."""
    committed = sorted(i for key in storage.list(results_prefix)
                       if (i := committed_index(key.rsplit("/", 1)[-1])) is not None)
    for index in committed:
        with storage.open(shard_keys(results_prefix, index)[0]) as f:
            while chunk := f.read(chunk_bytes):
                yield chunk


@dataclass
class MergeResult:
    """Totals of a merged batch."""

    request_counts: RequestCounts
    usage: Usage
    error_codes: dict[str, int]
    reused: int = 0


def merge(
    storage: Storage,
    results_prefix: str,
    shard_count: int,
    output_path: Path,
    error_path: Path,
    *,
    not_run: Iterable[dict[str, Any]] = (),
    missing_ok: bool = False,
) -> MergeResult:
    """Concatenate committed shards into local output and error files, written whole.

    `not_run` adds lines for requests that never ran (batch cancelled or expired); those are the
    requests of the shards left uncommitted, which `missing_ok` allows. Otherwise a missing shard
    is an error, so no request is silently dropped.
    """
    shards = committed_shards(storage, results_prefix)
    missing = [i for i in range(shard_count) if i not in shards]
    if missing and not missing_ok:
        raise ValueError(f"Shards not committed: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    counts, usage, reused = RequestCounts(), Usage(), 0
    codes: dict[str, int] = {}
    for path in (output_path, error_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "wb") as out, open(error_path, "wb") as err:
        for index in range(shard_count):
            if index not in shards:
                continue
            shard = shards[index]
            counts += shard.request_counts
            usage += shard.usage
            reused += shard.reused
            for code, n in shard.error_codes.items():
                codes[code] = codes.get(code, 0) + n
            shard_out, shard_err, _ = shard_keys(results_prefix, index)
            for src, dst in ((shard_out, out), (shard_err, err)):
                with storage.open(src) as f:
                    while chunk := f.read(1 << 20):
                        dst.write(chunk)
        for line in not_run:
            counts.total += 1
            counts.failed += 1
            code = error_code(line)
            codes[code] = codes.get(code, 0) + 1
            err.write(c.jsonl_line(line))
    return MergeResult(counts, usage, codes, reused)


def iter_lines(storage: Storage, key: str):
    """Parsed lines of an output or error file, streamed."""
    with storage.open(key) as f:
        for raw in f:
            if raw.strip():
                yield orjson.loads(raw)
