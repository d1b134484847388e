"""Readable labels for a batch's runs and materializations: what an analyst recognises a batch by in the UI."""

from __future__ import annotations

import re

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


def stored_batch_tags(session: Session, batch_id: str, *, source: str) -> dict[str, str]:
    """`batch_tags` of a batch in the store (its input file's name from the File record)."""
    batch = session.scalar(select(BatchRecord).where(BatchRecord.id == batch_id))
    if batch is None:
        return {"batch_id": batch_id, "source": source}
    filename = session.scalar(select(FileRecord.filename).where(FileRecord.id == batch.input_file_id))
    return batch_tags(batch_id, source=source, filename=filename, owner=batch.owner)
