"""Every tag of a batch's run, and how owners are shown in them: what an analyst recognises a batch by in the UI."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from batch_dagster.db.models import BatchRecord, FileRecord
from batch_dagster.db.repo import owner_of_key

OWNER_TAG = "owner"  # the owner's label: shown in the UI, and what the run queue shares runs by (defs/fairness.py)
_HASHED = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class OwnerLabels:
    """How owners are shown in run tags and the UI: the operator's name for a key (`name:key` in BATCH_API_KEYS),
    else `key-` and 12 hex digits of an HMAC of the owner keyed with the server's keys.

    The stored owner is the key's SHA-256; a prefix of it would let anyone who reads the UI test guesses of a key
    offline. The keyed hash needs every configured key to compute, so it says nothing about any one of them.
    """

    names: dict[str, str] = field(default_factory=dict)  # owner -> name
    secret: bytes = b""

    @classmethod
    def of(cls, entries: Iterable[tuple[str | None, str]], *extra_keys: str) -> OwnerLabels:
        """From (name or None, key) pairs (settings.split_key of BATCH_API_KEYS) and other keys the server holds."""
        pairs = list(entries)
        keys = sorted({key for _, key in pairs} | {k for k in extra_keys if k})
        secret = hashlib.sha256(b"batch-dagster owner labels\0" + "\0".join(keys).encode()).digest()
        return cls({owner_of_key(key): name for name, key in pairs if name}, secret)

    def label(self, owner: str) -> str:
        if owner in self.names:
            return self.names[owner]
        if _HASHED.fullmatch(owner):
            return "key-" + hmac.new(self.secret, owner.encode(), hashlib.sha256).hexdigest()[:12]
        return owner[:64]


WAY_IN_TAG = "source"  # the way in a batch came by: api, cli, s3 or inbox


def batch_tags(batch_id: str, *, way_in: str, filename: str | None, owner: str,
               labels: OwnerLabels) -> dict[str, str]:
    """The run tags of a batch: its id, the way in it came by (api, cli, s3, inbox), its input file and owner."""
    tags = {"batch_id": batch_id, WAY_IN_TAG: way_in, OWNER_TAG: labels.label(owner)}
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


def run_tags(batch_id: str, *, way_in: str, filename: str | None, owner: str, model: str | None,
             vllm: RunQueue, labels: OwnerLabels) -> dict[str, str]:
    """Every tag of a batch's run, whoever requests it (the CLI's runner, the API and drop sensors): the batch's
    labels and the run queue's tags for its model, as recorded on the batch at creation."""
    return batch_tags(batch_id, way_in=way_in, filename=filename, owner=owner, labels=labels) | vllm.queue_tags(model)
