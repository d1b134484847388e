"""`python -m batch_dagster.serve` started by a test, with the project's dagster.yaml: the API, the real
Dagster daemon (sensors, run queue, run retries, backfills) and optionally the UI, plus their processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psutil
from openai import OpenAI

from .conftest import MODEL_CACHE, free_port, wait_http, write_jsonl

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-harness"


class Serve:
    """serve in `tmp_path` (its DAGSTER_HOME links the repo's dagster.yaml); `module` replaces the project's
    definitions (a workspace.yaml in the working directory points the daemon at it)."""

    def __init__(self, tmp_path: Path, *, module: str | None = None, ui: bool = False, **env: str):
        self.tmp_path, self.module, self.ui = tmp_path, module, ui
        self.home, self.data_dir = tmp_path / "dagster_home", tmp_path / "data"
        self.api_port, self.ui_port = free_port(), free_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith(("BATCH_", "DAGSTER_"))}
        self.env = base | {"DAGSTER_HOME": str(self.home), "BATCH_DATA_DIR": str(self.data_dir),
                           "BATCH_MODEL_CACHE": str(MODEL_CACHE), "BATCH_API_KEYS": API_KEY} | env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Serve:
        if self.module:
            (self.tmp_path / "workspace.yaml").write_text(
                f"load_from:\n  - python_module:\n      module_name: {self.module}\n"
                f"      working_directory: {REPO}\n      location_name: tests\n")
        self.log = open(self.tmp_path / "serve.log", "w")
        command = [sys.executable, "-m", "batch_dagster.serve", "--port", str(self.api_port)]
        command += ["--dagster-port", str(self.ui_port)] if self.ui else ["--no-ui"]
        self.proc = subprocess.Popen(command, cwd=self.tmp_path, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(f"http://127.0.0.1:{self.api_port}/health", 60, self.proc)
            if self.ui:
                wait_http(f"{self.ui_url}/server_info", 120, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """Ctrl-C, as in a terminal; whatever is left after that is killed, so no test leaks processes."""
        descendants = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        os.kill(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in descendants:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}"

    def logs(self, tail: int = 4000) -> str:
        self.log.flush()
        return (self.tmp_path / "serve.log").read_text()[-tail:]

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.api_port}/v1", api_key=API_KEY, max_retries=0, timeout=30)

    def create_batch(self, rows: list[dict], name: str = "in.jsonl"):
        client = self.client()
        with open(write_jsonl(self.tmp_path / name, rows), "rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")

    def wait_for(self, batch_id: str, statuses: set[str], timeout_s: float):
        client, deadline = self.client(), time.time() + timeout_s
        while (batch := client.batches.retrieve(batch_id)).status not in statuses:
            if time.time() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"{batch_id} is still {batch.status}\n{self.logs()}")
            time.sleep(0.5)
        return batch

    @contextmanager
    def instance(self):
        """The Dagster instance the daemon writes to, read from the test."""
        saved = os.environ.get("DAGSTER_HOME")
        os.environ["DAGSTER_HOME"] = str(self.home)
        try:
            with dg.DagsterInstance.from_config(str(self.home)) as instance:
                yield instance
        finally:
            if saved is None:
                os.environ.pop("DAGSTER_HOME", None)
            else:
                os.environ["DAGSTER_HOME"] = saved

    def engine_step(self) -> psutil.Process | None:
        """The step process holding a vLLM engine (its engine-core child is named VLLM::...), if any."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if any(c.name().startswith("VLLM") for c in p.children()):
                    return p
            except psutil.NoSuchProcess:
                continue
        return None


def batch_runs(instance: dg.DagsterInstance, batch_id: str, timeout_s: float = 60) -> list[dg.DagsterRun]:
    """The batch's runs, oldest first, once the newest has finished (the API's batch ends a little before)."""
    deadline = time.time() + timeout_s
    while True:
        runs = instance.get_runs(dg.RunsFilter(job_name="batch_job", tags={"dagster/partition": batch_id}))
        if (runs and runs[0].is_finished) or time.time() > deadline:
            return list(reversed(runs))
        time.sleep(0.5)


def step_events(instance: dg.DagsterInstance, run_id: str, event_type: dg.DagsterEventType, step_key: str) -> list:
    records = instance.get_records_for_run(run_id, of_type=event_type).records
    return [r for r in records if r.event_log_entry.step_key == step_key]


def materialization_metadata(instance: dg.DagsterInstance, run_id: str, asset: str) -> dict:
    for record in instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records:
        materialization = record.event_log_entry.asset_materialization
        if materialization.asset_key == dg.AssetKey(asset):
            return {k: v.value for k, v in materialization.metadata.items()}
    raise KeyError(f"{asset} was not materialized in run {run_id}")


def file_stats(paths) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of each file: a rewrite (even atomic, by rename) changes one of them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}
