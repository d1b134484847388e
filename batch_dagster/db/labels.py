"""Readable labels for a batch's runs and materializations: what an analyst recognises a batch by in the UI."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import BatchRecord, FileRecord

_HASHED = re.compile(r"[0-9a-f]{64}")


def owner_label(owner: str) -> str:
    """The owner as shown: a key's SHA-256 cut to 12 hex digits (never the key), else the owner's name."""
    return f"key-{owner[:12]}" if _HASHED.fullmatch(owner) else owner[:64]


def batch_tags(batch_id: str, *, source: str, filename: str | None, owner: str) -> dict[str, str]:
    """The run tags of a batch: its id, where it came from (api, cli, s3, inbox), its input file and owner."""
    tags = {"batch_id": batch_id, "source": source, "owner": owner_label(owner)}
    if filename:
        tags["filename"] = filename[:255]
    return tags


def input_filenames(session: Session, batches: Sequence[BatchRecord]) -> dict[str, str]:
    """The name of each batch's input file (from its File record), by batch id: one query for them all."""
    by_file = {b.input_file_id: b.id for b in batches}
    rows = session.execute(select(FileRecord.id, FileRecord.filename).where(FileRecord.id.in_(list(by_file))))
    return {by_file[file_id]: filename for file_id, filename in rows}


class RunQueue(Protocol):
    """What says a model's run-queue tags (the vLLM resource: defs/run_limits.py's queue_tags for its servers)."""

    def queue_tags(self, model: str | None) -> dict[str, str]: ...


def run_tags(batch_id: str, *, source: str, filename: str | None, owner: str, model: str | None,
             vllm: RunQueue) -> dict[str, str]:
    """Every tag of a batch's run, whoever requests it (the CLI's runner, the API and drop sensors): the batch's
    labels and the run queue's tags for its model, as recorded on the batch at creation."""
    return batch_tags(batch_id, source=source, filename=filename, owner=owner) | vllm.queue_tags(model)
