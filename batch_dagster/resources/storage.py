"""Where each batch's files live: one folder per batch under the data dir, named by the data flow."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import orjson


class BatchStorage(dg.ConfigurableResource):
    """Local batch folders: input -> requests -> shards -> results -> output/errors -> summary."""

    data_dir: str

    def batch_dir(self, batch_id: str) -> Path:
        return Path(self.data_dir) / "batches" / batch_id

    def input_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "input.jsonl"

    def validation_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "validation.json"

    def requests_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "requests.parquet"

    def shards_dir(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "shards"

    def results_dir(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "results"

    def output_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "output.jsonl"

    def error_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "errors.jsonl"

    def summary_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "summary.json"

    def put_input(self, batch_id: str, source: Path) -> Path:
        """Copy an input file into the batch's folder (the pipeline never reads outside it)."""
        dest = self.input_path(batch_id)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(source, tmp)
        tmp.replace(dest)
        return dest

    def write_json(self, path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        tmp.replace(path)

    def read_json(self, path: Path) -> Any:
        return orjson.loads(path.read_bytes()) if path.exists() else None
