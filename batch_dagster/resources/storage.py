"""Batch folders as a Dagster resource: a thin wrapper around the batch folder contract (batchfile/folder.py)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.storage import LocalStorage


class BatchStorage(dg.ConfigurableResource):
    """Where batch folders live: `data_dir/batches/<batch_id>/` on local disk."""

    data_dir: str

    def storage(self) -> LocalStorage:
        return LocalStorage(self.data_dir)

    def folder(self, batch_id: str) -> BatchFolder:
        return BatchFolder(self.storage(), batch_id)

    @property
    def files_dir(self) -> Path:
        """Where uploaded and dropped files' bytes are kept."""
        return Path(self.data_dir) / "files"
