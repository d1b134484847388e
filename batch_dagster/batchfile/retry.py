"""Retrying a batch's failed requests: which error lines are retryable, the child's input, merged results.

A request is retried only when its failure was not its own: a 5xx line (engine_error, out_of_memory)
or a request that never ran (batch_expired, batch_cancelled, or batch_failed: its batch's run failed
first). A 4xx line would fail again the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from . import contract as c

NOT_RUN_CODES = (c.BATCH_EXPIRED, c.BATCH_CANCELLED, c.BATCH_FAILED, c.COST_LIMIT_EXCEEDED)  # a retry runs them


def is_retryable(line: dict[str, Any]) -> bool:
    """Whether an error-file line failed for a reason that is not the request's own."""
    response = line.get("response")
    if response:
        return int(response.get("status_code") or 0) >= 500
    return (line.get("error") or {}).get("code") in NOT_RUN_CODES


def retryable_ids(lines: Iterable[bytes]) -> list[str]:
    """The custom_ids of the retryable lines of an error file (its raw lines), in file order."""
    return [line["custom_id"] for raw in lines if raw.strip() and is_retryable(line := orjson.loads(raw))]


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
                    out.write(b'{"custom_id":' + orjson.dumps(cid) + b',"method":"POST","url":' + orjson.dumps(endpoint)
                              + b',"body":' + body.encode() + b"}\n")
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
            yield raw if raw.endswith(b"\n") else raw + b"\n"
    for raw in child_lines:
        if raw.strip():
            yield raw if raw.endswith(b"\n") else raw + b"\n"
