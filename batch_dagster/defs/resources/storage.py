"""Batch folders as a Dagster resource: a thin wrapper around the batch folder contract (batchfile/folder.py)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from pydantic_core import PydanticUndefined

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.storage import Storage
from batch_dagster.settings import open_batch_storage, storage_location

from .setting_fields import setting


class StorageResource(dg.ConfigurableResource):
    """Where batch folders and files live: `url` (a local path or s3://bucket/prefix; empty: `data_dir`).

    `data_dir` is this process's own local folder; with a remote `url` it holds only scratch.
    """

    data_dir: str = setting("BATCH_DATA_DIR", default=PydanticUndefined)  # where this process runs: always given
    url: str = setting("BATCH_STORAGE_URL", default="")

    def open(self) -> Storage:
        """The batch storage this resource names, opened."""
        return open_batch_storage(self.data_dir, self.url)

    @property
    def scratch_dir(self) -> Path:
        """This process's local scratch (used by a remote store)."""
        return storage_location(self.data_dir, self.url)[1]

    def folder(self, batch_id: str) -> BatchFolder:
        return BatchFolder(self.open(), batch_id)
