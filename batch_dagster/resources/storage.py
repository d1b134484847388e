"""Where each batch's files live: one folder per batch under the data dir, named by the data flow."""

from __future__ import annotations

import shutil
import time
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

    def progress_path(self, batch_id: str) -> Path:
        """Requests finished so far in the shard being inferred (the live part of request_counts)."""
        return self.results_dir(batch_id) / "progress.json"

    def output_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "output.jsonl"

    def error_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "errors.jsonl"

    def summary_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "summary.json"

    def stop_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "stop.json"

    def deadline_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "deadline.json"

    def source_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "source.json"

    def set_source(self, batch_id: str, uri: str, file_path: Path) -> None:
        """A dropped file's batch: batch_input fetches `uri` to `file_path` (its File) and copies it in."""
        self.write_json(self.source_path(batch_id), {"uri": uri, "file_path": str(file_path)})

    def source(self, batch_id: str) -> dict[str, str] | None:
        return self.read_json(self.source_path(batch_id))

    def set_endpoint(self, batch_id: str, endpoint: str) -> None:
        """The endpoint the batch was created for: every request's url must match it."""
        self.write_json(self.batch_dir(batch_id) / "batch.json", {"endpoint": endpoint})

    def endpoint(self, batch_id: str) -> str | None:
        """The batch's declared endpoint, or None (the first request's url then decides)."""
        return (self.read_json(self.batch_dir(batch_id) / "batch.json") or {}).get("endpoint")

    def request_stop(self, batch_id: str, reason: str) -> None:
        """Ask a running batch to stop before its next shard (reason: "cancelled" or "expired")."""
        self.write_json(self.stop_path(batch_id), {"reason": reason, "at": time.time()})

    def set_deadline(self, batch_id: str, expires_at: float) -> None:
        """The time (epoch seconds) after which no new shard starts: the batch expires."""
        self.write_json(self.deadline_path(batch_id), {"expires_at": expires_at})

    def stop_reason(self, batch_id: str) -> str | None:
        """Why the batch must stop now ("cancelled" or "expired"), or None to go on."""
        stop = self.read_json(self.stop_path(batch_id))
        if stop is not None:
            return stop["reason"]
        deadline = self.read_json(self.deadline_path(batch_id))
        if deadline is not None and time.time() >= deadline["expires_at"]:
            return "expired"
        return None

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
