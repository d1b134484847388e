"""The `batch-dagster` command line: validate a file, run a batch through Dagster, run the demo."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from batch_dagster.batchfile.contract import Limits
from batch_dagster.batchfile.validate import validate_file
from batch_dagster.settings import Settings


def _print_json(data: Any) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def cmd_validate(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    limits = Limits(
        max_requests=args.max_requests or settings.limits.max_requests,
        max_bytes=args.max_bytes or settings.limits.max_bytes,
        max_line_bytes=settings.limits.max_line_bytes,
    )
    from batch_dagster.batchfile.registry import load_registry, served_endpoints

    models = served_endpoints(load_registry(settings.models_file))
    report = validate_file(args.file, limits=limits, endpoint=args.endpoint, models=models)
    if args.json:
        _print_json(report.to_dict())
    else:
        if report.valid:
            print(f"valid: {report.total_requests} requests, model {report.model}, endpoint {report.endpoint}")
        else:
            print(f"invalid: {report.error_count} error(s) in {report.total_requests} requests", file=sys.stderr)
            for e in report.errors:
                where = f"line {e.line}" if e.line is not None else "file"
                field = f" ({e.param})" if e.param else ""
                print(f"  {where}{field}: [{e.code}] {e.message}", file=sys.stderr)
    return 0 if report.valid else 1


class _Progress(threading.Thread):
    """A progress bar over the batch's committed shards, read from storage while the run goes on."""

    def __init__(self, storage: Any, batch_id: str, enabled: bool):
        super().__init__(daemon=True)
        self.storage, self.batch_id, self.enabled = storage, batch_id, enabled
        self.stop = threading.Event()

    def run(self) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        from batch_dagster.batchfile.results import committed_shards

        bar, shown = None, None
        while not self.stop.wait(0.5):
            manifest = self.storage.read_json(self.storage.shards_dir(self.batch_id) / "manifest.json")
            if manifest is None:
                continue
            if bar is None:
                bar = tqdm(total=manifest["total_requests"], unit="req", desc="requests", file=sys.stderr)
            shards = committed_shards(self.storage.results_dir(self.batch_id))
            done = sum(s.request_counts.total for s in shards.values())
            failed = sum(s.request_counts.failed for s in shards.values())
            live = self.storage.read_json(self.storage.progress_path(self.batch_id))
            if live is not None and live["shard"] not in shards:
                done += live["done"]
            state = (done, failed, len(shards))
            if state != shown:  # redraw only on change: a log file gets one line per step, not per tick
                shown = state
                bar.set_postfix(failed=failed, shards=f"{len(shards)}/{manifest['shard_count']}", refresh=False)
                bar.update(done - bar.n)
        if bar is not None:
            bar.close()


def run_batch(
    file: Path, out_dir: Path, *, show_progress: bool = True, defs: Any = None, instance: Any = None
) -> dict[str, Any]:
    """Register a batch partition, materialize its lifecycle through Dagster, copy the files to out_dir.

    `defs` and `instance` default to the project's definitions and instance (DAGSTER_HOME).
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM logs to stdout by default; stdout belongs to the results (--json).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import dagster as dg

    from batch_dagster.partitions import batches

    if defs is None:
        from batch_dagster.definitions import defs
    if instance is None:
        from batch_dagster.instance import ensure_dagster_home

        ensure_dagster_home()
        instance = dg.DagsterInstance.get()

    storage = defs.resources["storage"]
    batch_id = f"batch_{uuid.uuid4().hex}"
    started = time.perf_counter()
    storage.put_input(batch_id, file)
    record = _BatchRecord(defs, storage, batch_id, file)
    instance.add_dynamic_partitions(batches.name, [batch_id])
    progress = _Progress(storage, batch_id, show_progress)
    progress.start()
    try:
        result = defs.resolve_job_def("batch_job").execute_in_process(
            partition_key=batch_id,
            instance=instance,
            raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
            tags={"batch_id": batch_id, "source": "cli"},
        )
    finally:
        progress.stop.set()
        progress.join()
    record.sync(None if result.success else _failure_message(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    output_file, error_file = out_dir / "output.jsonl", out_dir / "errors.jsonl"
    summary = storage.read_json(storage.summary_path(batch_id)) if result.success else None
    if summary is not None:
        shutil.copyfile(storage.output_path(batch_id), output_file)
        shutil.copyfile(storage.error_path(batch_id), error_file)
        keys = ("batch_id", "status", "model", "endpoint", "request_counts", "usage", "cost", "inference_s",
                "output_tokens_per_s")
        summary = {k: summary[k] for k in keys}
    else:
        output_file.write_bytes(b"")
        error_file.write_bytes(b"")
        validation = storage.read_json(storage.validation_path(batch_id)) or {}
        errors = validation.get("errors") or [{"code": "pipeline_error", "message": _failure_message(result),
                                               "line": None, "param": None}]
        summary = {"batch_id": batch_id, "status": "failed", "model": validation.get("model"),
                   "endpoint": validation.get("endpoint"), "request_counts": {"total": validation.get("total_requests", 0),
                   "completed": 0, "failed": 0}, "usage": None, "cost": None, "errors": errors}
    return summary | {
        "run_id": result.run_id,
        "output_file": str(output_file),
        "error_file": str(error_file),
        "duration_s": round(time.perf_counter() - started, 3),
    }


class _BatchRecord:
    """The batch in the API's metadata store, when the definitions have one: the one record of batches
    (the daily usage report reads it), listed under the owner of dropped files' batches."""

    def __init__(self, defs: Any, storage: Any, batch_id: str, file: Path):
        from batch_dagster.store import repo
        from batch_dagster.store.intake import record_local_batch

        self.api_store, self.storage, self.batch_id = defs.resources.get("api_store"), storage, batch_id
        intake = defs.resources.get("intake")
        self.owner = intake.owner if intake is not None else repo.ANONYMOUS
        if self.api_store is not None:
            with self.api_store.session() as session:
                record_local_batch(session, storage, batch_id, file, owner=self.owner,
                                   files_dir=Path(storage.data_dir) / "files")

    def sync(self, run_failure: str | None) -> None:
        from batch_dagster.store import repo
        from batch_dagster.store.lifecycle import sync_batch

        if self.api_store is not None:
            with self.api_store.session() as session:
                batch = repo.get_batch(session, self.owner, self.batch_id)
                sync_batch(session, self.storage, batch, run_failure=run_failure)


def _failure_message(result: Any) -> str:
    for event in result.all_events:
        if event.is_failure and event.step_failure_data is not None:
            return event.step_failure_data.error.message.strip() if event.step_failure_data.error else "step failed"
    return "The run failed."


def _print_summary(summary: dict[str, Any]) -> None:
    rc = summary["request_counts"]
    print(f"batch {summary['batch_id']}: {summary['status']}")
    if summary["status"] != "completed":
        for e in summary.get("errors", [])[:20]:
            where = f"line {e['line']}" if e.get("line") is not None else "file"
            print(f"  {where}: [{e['code']}] {e['message']}", file=sys.stderr)
        return
    usage, cost = summary["usage"], summary["cost"]
    print(f"  requests: {rc['total']} total, {rc['completed']} completed, {rc['failed']} failed")
    print(f"  tokens:   {usage['input_tokens']} input, {usage['output_tokens']} output "
          f"({summary['output_tokens_per_s']} output tokens/s over {summary['inference_s']:.1f}s of inference)")
    print(f"  cost:     {cost['total_cost']:.6f} {cost['currency']} (batch discount {cost['batch_discount']:.0%})")
    print(f"  output:   {summary['output_file']}\n  errors:   {summary['error_file']}")
    print(f"  took:     {summary['duration_s']:.1f}s")


def cmd_run(args: argparse.Namespace) -> int:
    summary = run_batch(Path(args.file), Path(args.out), show_progress=not args.json and not args.quiet)
    if args.json:
        _print_json(summary)
    else:
        _print_summary(summary)
    return 0 if summary["status"] == "completed" else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from batch_dagster.demo.report import run_demo

    return run_demo(Path(args.out))


def cmd_vllm_server(args: argparse.Namespace) -> int:
    """Start (exec) a vLLM server for a registry model, for `BATCH_ENGINE_MODE=server`."""
    from batch_dagster.engine.server import server_command
    from batch_dagster.resources.config import resources_from_env

    vllm = resources_from_env()["vllm"]
    spec = vllm.spec(args.model)
    command = server_command(spec, vllm.model_path(spec), args.host, args.port)
    print(" ".join(command), file=sys.stderr)
    os.execv(command[0], command)
    return 0


def cmd_instance(args: argparse.Namespace) -> int:
    from batch_dagster.instance import ensure_dagster_home

    print(f"DAGSTER_HOME={ensure_dagster_home()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batch-dagster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a batch input file; exit 1 when invalid")
    p.add_argument("file")
    p.add_argument("--endpoint", help="the batch endpoint (default: the first line's url)")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--max-bytes", type=int)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="run a batch file through the Dagster pipeline")
    p.add_argument("file")
    p.add_argument("--out", required=True, help="folder for output.jsonl and errors.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="run the built-in sample batch on the default model")
    p.add_argument("--out", default="data/demo-output")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("vllm-server", help="start a vLLM OpenAI-compatible server for a registry model")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.set_defaults(func=cmd_vllm_server)

    p = sub.add_parser("instance", help="prepare DAGSTER_HOME with this project's dagster.yaml")
    p.set_defaults(func=cmd_instance)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except OSError as exc:  # a missing or unreadable file is a usage error, not a crash
        parser.exit(2, f"batch-dagster: error: {exc.strerror or exc}: {exc.filename or ''}\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
