"""The `batch-dagster` command line: validate a file, run a batch through Dagster, run the demo."""

from __future__ import annotations

import argparse
import os
import sys
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
        rejected = {"rejected_count": report.rejected_count, "rejected": [e.to_dict() for e in report.rejected]}
        _print_json(report.to_dict() | (rejected if report.rejected_count else {}))
    else:
        if report.valid:
            print(f"valid: {report.total_requests} requests, model {report.model}, endpoint {report.endpoint}")
            if report.rejected_count:
                print(f"{report.rejected_count} request(s) will end as 400 lines in the error file:", file=sys.stderr)
            for e in report.rejected:
                print(f"  line {e.line} ({e.param}): [{e.code}] {e.message}", file=sys.stderr)
        else:
            print(f"invalid: {report.error_count} error(s) in {report.total_requests} requests", file=sys.stderr)
            for e in report.errors:
                where = f"line {e.line}" if e.line is not None else "file"
                field = f" ({e.param})" if e.param else ""
                print(f"  {where}{field}: [{e.code}] {e.message}", file=sys.stderr)
    return 0 if report.valid else 1


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
    from batch_dagster.runner import run_batch

    summary = run_batch(Path(args.file), Path(args.out), show_progress=not args.json and not args.quiet)
    if args.json:
        _print_json(summary)
    else:
        _print_summary(summary)
    return 0 if summary["status"] == "completed" else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from batch_dagster.demo.run import run_demo

    return run_demo(Path(args.out))


def cmd_vllm_server(args: argparse.Namespace) -> int:
    """Start (exec) a vLLM server for a registry model, for `BATCH_ENGINE_MODE=server`."""
    from batch_dagster.engine.server import server_command
    from batch_dagster.resources.from_env import resources_from_env

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
