"""The `batch-dagster` command line: validate or estimate a file, run a batch through Dagster, run the demo."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import orjson

from batch_dagster.batchfile.contract import RETRY_FILTERS, Limits
from batch_dagster.batchfile.outcome import RunOutcome
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.validate import validate_file
from batch_dagster.settings import LOOPBACK, VLLM_SERVER_PORT, Settings


def _print_json(data: Any) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def cmd_validate(args: argparse.Namespace, settings: Settings) -> int:
    limits = Limits(
        max_requests=args.max_requests or settings.limits.max_requests,
        max_bytes=args.max_bytes or settings.limits.max_bytes,
        max_line_bytes=settings.limits.max_line_bytes,
    )
    from batch_dagster.batchfile.registry import load_registry, served

    models = served(load_registry(settings.models_file), settings.image_sources)
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


def cmd_estimate(args: argparse.Namespace, settings: Settings) -> int:
    """What a batch of FILE would cost and take: tokens counted as the engine counts them, priced, timed against
    the store's record of the model's recent batches and its queue (POST /v1/batches/estimate's answer)."""
    from batch_dagster.db import Database
    from batch_dagster.engine.models import Models
    from batch_dagster.engine.tokens import CountFailed, CountTimeout
    from batch_dagster.features.estimate import estimate_file

    store = Database(settings.database_url)
    store.upgrade()
    try:
        with store.session() as session, open(args.file, "rb", buffering=1 << 20) as f:
            estimate = estimate_file(f, size=os.fstat(f.fileno()).st_size, endpoint=args.endpoint, session=session,
                                     storage=settings.storage(), models=Models.from_settings(settings),
                                     settings=settings)
    except (CountTimeout, CountFailed) as exc:
        print(f"not counted: {exc}", file=sys.stderr)
        return 1
    finally:
        store.dispose()
    data = estimate.to_dict()
    if args.json:
        _print_json(data)
        return 0 if estimate.report.valid else 1
    if not estimate.report.valid:
        print(f"invalid: {estimate.report.error_count} error(s) in {data['total_requests']} requests", file=sys.stderr)
        for e in estimate.report.listed_errors:
            where = f"line {e.line}" if e.line is not None else "file"
            print(f"  {where}{f' ({e.param})' if e.param else ''}: [{e.code}] {e.message}", file=sys.stderr)
        return 1
    cost, duration = data["cost"], data["duration_s"]
    measured = (f"measured on {data['throughput_batches']} recent batch(es)" if data["throughput_batches"]
                else "the BATCH_ESTIMATE_TOKENS_PER_S default")
    print(f"valid: {data['total_requests']} requests, model {data['model']}, endpoint {data['endpoint']}")
    if data["refused_requests"]:
        print(f"  refused:  {data['refused_requests']} request(s) will end as error lines without running")
    print(f"  tokens:   {data['input_tokens']} input, at most {data['max_output_tokens']} output")
    print(f"  cost:     {cost['min']:.6f} to {cost['max']:.6f} {cost['currency']}")
    _price_note(data["model"], settings)
    print(f"  duration: {duration['min']:.1f} s to {duration['max']:.1f} s at {data['tokens_per_s']} tokens/s "
          f"({measured})")
    print(f"  queued:   {data['queued_ahead']} batch(es) of this model ahead, "
          f"{data['queued_ahead_requests']} request(s) not finished")
    return 0


def _price_note(model: str | None, settings: Settings) -> None:
    """Say so when the model has no price of its own: its cost is the price table's defaults (0 as shipped)."""
    from batch_dagster.batchfile.usage import load_price_table

    if model and (unpriced := load_price_table(settings.prices_file).unlisted(model)):
        print(f"  note:     {unpriced}; add it to {settings.prices_file} (BATCH_PRICES_FILE)", file=sys.stderr)


def _print_summary(run: RunOutcome, settings: Settings) -> None:
    outcome = run.batch
    rc = outcome.request_counts
    print(f"batch {outcome.batch_id}: {outcome.status}")
    if outcome.status != BatchStatus.COMPLETED:
        errors = outcome.errors or []
        for e in errors[:20]:
            where = f"line {e.line}" if e.line is not None else "file"
            field = f" ({e.param})" if e.param else ""
            print(f"  {where}{field}: [{e.code}] {e.message}", file=sys.stderr)
        if len(errors) > 20:
            print(f"  ... and {len(errors) - 20} more", file=sys.stderr)
        if outcome.usage is not None:  # it kept what its run finished
            print(f"  requests: {rc.describe()}")
            print(f"  output:   {run.output_file}\n  errors:   {run.error_file}")
        if run.log_file:
            print(f"  log:      {run.log_file}", file=sys.stderr)
        return
    usage, cost = outcome.usage, outcome.cost
    assert usage is not None and cost is not None  # a batch that ended has both
    print(f"  requests: {rc.describe()}")
    print(f"  tokens:   {usage.input_tokens} input, {usage.output_tokens} output "
          f"({outcome.output_tokens_per_s} output tokens/s over {outcome.inference_s or 0:.1f}s of inference)")
    print(f"  cost:     {cost.total_cost:.6f} {cost.currency} (batch discount {cost.batch_discount:.0%})")
    _price_note(outcome.model, settings)
    if outcome.engine is not None:
        print(f"  engine:   {outcome.engine.describe()}")
    print(f"  output:   {run.output_file}\n  errors:   {run.error_file}")
    print(f"  took:     {run.duration_s:.1f}s")
    if run.log_file:
        print(f"  log:      {run.log_file}")


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from batch_dagster.defs.instance import PG_URL_VARIABLE, pg_url_problem
    from batch_dagster.defs.runner import run_batch

    if problem := pg_url_problem(os.environ.get(PG_URL_VARIABLE, "")):  # refused before a run starts
        print(f"error: {problem}", file=sys.stderr)
        return 2

    run = run_batch(Path(args.file), Path(args.out), show_progress=not args.json and not args.quiet,
                    log_dir=settings.data_dir / "logs", settings=settings)
    if args.json:
        _print_json(run.to_dict())
    else:
        _print_summary(run, settings)
    return 0 if run.batch.status == BatchStatus.COMPLETED else 1


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from batch_dagster.demo.run import run_demo

    return run_demo(Path(args.out), settings)


def cmd_retry(args: argparse.Namespace, settings: Settings) -> int:
    """Create a child batch of a batch's retryable failed requests; the daemon's API sensor launches it."""
    from sqlalchemy import select

    from batch_dagster.db import BatchRecord, Database
    from batch_dagster.db.lifecycle import sync_batch
    from batch_dagster.features.retry import CannotRetry, create_retry

    store = Database(settings.database_url)
    store.upgrade()
    storage = settings.storage()
    try:
        with store.session() as session:
            parent = session.scalar(select(BatchRecord).where(BatchRecord.id == args.batch_id))
            if parent is None:
                print(f"batch-dagster: error: no batch {args.batch_id} in {settings.database_url}", file=sys.stderr)
                return 1
            parent = sync_batch(session, storage, parent)
            try:
                child = create_retry(session, storage, parent, windows=settings.windows, only=args.only)
            except CannotRetry as exc:
                print(f"batch-dagster: error: {exc}", file=sys.stderr)
                return 1
            shown = {"id": child.id, "parent_batch_id": parent.id, "status": child.status,
                     "endpoint": child.endpoint, "input_file_id": child.input_file_id}
            total = child.request_total  # counted as its input was copied in
    finally:
        store.dispose()
    if args.json:
        _print_json(shown | {"requests": total})
    else:
        print(f"batch {shown['id']}: {total} request(s) of {parent.id} to retry; the Dagster daemon "
              "(make serve / make dev) runs it")
    return 0


def cmd_vllm_server(args: argparse.Namespace, settings: Settings) -> int:
    """Start (exec) a vLLM server for a registry model, for `BATCH_ENGINE_MODE=server`."""
    from batch_dagster.engine.models import Models
    from batch_dagster.engine.server import server_command

    models = Models.from_settings(settings)
    spec = models.spec(args.model)
    command = server_command(spec, models.path(spec), args.host, args.port)
    print(" ".join(command), file=sys.stderr)
    os.execv(command[0], command)
    return 0


def cmd_fleet(args: argparse.Namespace, settings: Settings) -> int:
    """Run N vLLM servers for a registry model behind vllm-router until Ctrl-C or SIGTERM."""
    import logging
    import signal
    import time

    from batch_dagster.serve.fleet import model_fleet

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        fleet = model_fleet(settings, args.model, args.replicas, args.port, args.policy, args.host)
    except ValueError as exc:  # more replicas than the GPUs go round
        print(f"batch-dagster: error: {exc}", file=sys.stderr)
        return 2

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        fleet.start()
        print(f"{fleet.url}/v1", flush=True)  # the router: point BATCH_VLLM_SERVER_URLS at it (without /v1)
        while True:  # until Ctrl-C or SIGTERM; a replica or the router that exits is restarted
            fleet.heal()
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:  # a port taken; a replica or the router that exited or hung starting
        print(f"batch-dagster: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()


def cmd_instance(args: argparse.Namespace, settings: Settings) -> int:
    from batch_dagster.defs.instance import PG_URL_VARIABLE, compute_logs_place, ensure_dagster_home

    try:
        home = ensure_dagster_home(settings)
    except ValueError as exc:  # a DAGSTER_PG_URL that cannot work, a run limit below 1
        print(f"error: {exc}", file=sys.stderr)
        return 2
    storage = f"postgres ({PG_URL_VARIABLE})" if os.environ.get(PG_URL_VARIABLE) else "sqlite"
    logs = compute_logs_place(settings.storage_url)
    print(f"DAGSTER_HOME={home} storage={storage}" + (f" compute_logs=s3://{logs[0]}/{logs[1]}" if logs else ""))
    return 0


def cmd_models(args: argparse.Namespace, settings: Settings) -> int:
    from batch_dagster.engine.prepare import prepare_models

    prepare_models(settings)
    return 0


def cmd_db(args: argparse.Namespace, settings: Settings) -> int:
    from batch_dagster.db import Database

    store = Database(settings.database_url)
    if args.action == "revision":
        store.revision(args.message)
    else:
        store.upgrade()
        print(f"upgraded {settings.database_url}")
    return 0


def cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    """Manage the API's keys in its store (BATCH_DATABASE_URL): the API refuses a revoked or rotated key from its
    next request on. A new key is printed once, on stdout; the store keeps its SHA-256 only."""
    from batch_dagster.db import Database, keys

    store = Database(settings.database_url)
    store.upgrade()
    limits = keys.Limits(getattr(args, "max_active_batches", None), getattr(args, "max_stored_bytes", None),
                         getattr(args, "daily_budget", None), getattr(args, "max_priority", None))
    try:
        with store.session() as session:
            key = None
            if args.action == "list":
                rows = keys.list_keys(session, revoked=args.all)
            elif args.action == "create":
                row, key = keys.create(session, args.name, admin=args.admin, limits=limits)
                rows = [row]
            elif args.action == "rotate":
                row, key = keys.rotate(session, args.name)
                rows = [row]
            elif args.action == "revoke":
                rows = [keys.revoke(session, args.name)]
            else:
                rows = [keys.set_limits(session, args.name, limits, admin=args.admin)]
            shown = [_key_record(row) for row in rows]
    except keys.KeyProblem as exc:
        print(f"batch-dagster: error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.dispose()
    if args.json:
        _print_json(shown if args.action == "list" else {**shown[0], **({"key": key} if key else {})})
        return 0
    for record in shown:
        limits_text = ", ".join(f"{k}={'default' if v is None else v}" for k, v in record["limits"].items())
        state = "revoked" if record["revoked_at"] else "admin" if record["admin"] else "key"
        print(f"{record['name']}\t{state}\t{limits_text}", file=sys.stderr if key else sys.stdout)
    if key:
        print(key)  # shown once: the store keeps its hash only
    return 0


def _key_record(row: Any) -> dict[str, Any]:
    from dataclasses import asdict

    from batch_dagster.db import keys

    return {"name": row.name, "admin": row.admin, "created_at": row.created_at, "created_by": row.created_by,
            "rotated_at": row.rotated_at, "revoked_at": row.revoked_at, "limits": asdict(keys.Limits.of(row))}


def _key_parsers(sub: Any) -> None:
    p = sub.add_parser("keys", help="manage the API's keys: create, list, revoke, rotate, limits (in its store)")
    actions = p.add_subparsers(dest="action", required=True)
    limits = argparse.ArgumentParser(add_help=False)
    for flag, kind, meaning in (("--max-active-batches", int, "batches not ended at once"),
                                ("--max-stored-bytes", int, "bytes of files kept"),
                                ("--daily-budget", float, "cost per UTC day"),
                                ("--max-priority", int, "the highest priority its batches may ask (-10..10)")):
        limits.add_argument(flag, type=kind, help=f"its own limit of {meaning}; 0: none; unset: the deployment's")
    listing = actions.add_parser("list", help="the keys (names, roles, limits; never the keys)")
    listing.add_argument("--all", action="store_true", help="the revoked keys too")
    create = actions.add_parser("create", help="a new key, printed once", parents=[limits])
    create.add_argument("name")
    create.add_argument("--admin", action="store_true", help="it may manage keys (/v1/keys)")
    for action, meaning in (("rotate", "a new key for the same owner, printed once; the old key stops working"),
                            ("revoke", "refuse the key from its next request on")):
        actions.add_parser(action, help=meaning).add_argument("name")
    change = actions.add_parser("limits", help="replace a key's limits (those not given: the deployment's)",
                                parents=[limits])
    change.add_argument("name")
    change.add_argument("--admin", action=argparse.BooleanOptionalAction, help="make it an admin key, or not")
    for action in actions.choices.values():
        action.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_keys)


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    """The command line, its defaults from `settings`."""
    from batch_dagster.settings import POLICIES

    parser = argparse.ArgumentParser(prog="batch-dagster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a batch input file; exit 1 when invalid")
    p.add_argument("file")
    p.add_argument("--endpoint", help="the batch endpoint (default: the first line's url)")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--max-bytes", type=int)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("estimate", help="what a batch of a file would cost and take (nothing runs); exit 1 when "
                       "invalid")
    p.add_argument("file")
    p.add_argument("--endpoint", help="the batch endpoint (default: the first line's url)")
    p.add_argument("--json", action="store_true", help="print one JSON object (POST /v1/batches/estimate's)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("run", help="run a batch file through the Dagster pipeline")
    p.add_argument("file")
    p.add_argument("--out", required=True, help="folder for output.jsonl and errors.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run, exit_at_once=True)

    p = sub.add_parser("demo", help="run the built-in sample batch on the default model")
    p.add_argument("--out", default="data/demo-output")
    p.set_defaults(func=cmd_demo, exit_at_once=True)

    p = sub.add_parser("retry", help="create a batch of a batch's failed requests that can be retried (5xx, "
                       "expired, cancelled), or of its lines whose structured answer does not follow its schema")
    p.add_argument("batch_id")
    p.add_argument("--only", nargs="+", choices=RETRY_FILTERS, default=[RETRY_FILTERS[0]],
                   help="which lines: failed (the default), invalid_structured (whole answers not following their "
                        "schema), incomplete_structured (structured answers cut short); several may be named")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_retry)

    p = sub.add_parser("vllm-server", help="start a vLLM OpenAI-compatible server for a registry model")
    p.add_argument("model")
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=VLLM_SERVER_PORT)
    p.set_defaults(func=cmd_vllm_server)

    p = sub.add_parser("fleet", help="N vLLM servers for a registry model behind vllm-router (Ctrl-C stops all)")
    p.add_argument("model")
    p.add_argument("--replicas", type=int, default=settings.fleet_replicas, help="default: BATCH_FLEET_REPLICAS")
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=settings.fleet_port, help="the router's port; replicas take the "
                   "next ports (default: BATCH_FLEET_PORT)")
    p.add_argument("--policy", default=settings.fleet_policy, choices=POLICIES, help="default: BATCH_FLEET_POLICY")
    p.set_defaults(func=cmd_fleet)

    p = sub.add_parser("instance", help="prepare DAGSTER_HOME with this project's dagster.yaml (storage on "
                                          "Postgres when DAGSTER_PG_URL is set; the run limits of the settings)")
    p.set_defaults(func=cmd_instance)
    p = sub.add_parser("models", help="prepare the registry's embedded models in BATCH_MODEL_CACHE (make models)")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("db", help="the API's store (BATCH_DATABASE_URL): upgrade it to the newest schema (the API "
                                  "and serve do at start), or write a new migration from the models")
    action = p.add_subparsers(dest="action", required=True)
    action.add_parser("upgrade", help="upgrade the store to the newest schema")
    action.add_parser("revision", help="write a new migration from the difference to the models").add_argument(
        "-m", "--message", required=True)
    p.set_defaults(func=cmd_db)
    _key_parsers(sub)
    return parser


def _exit_at_once(code: int) -> NoReturn:
    """End the process now, without the interpreter's teardown.

    Once a batch has run, its engine is stopped, its files are committed and its run is recorded: what is
    left is Python unloading torch, vLLM and Dagster object by object, 2 to 4 s on a CPU for nothing.
    Only the streams need flushing.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    settings = Settings.from_env()  # read once: every command takes them
    parser = build_parser(settings)
    args = parser.parse_args(argv)
    try:
        code = args.func(args, settings)
    except OSError as exc:  # a missing or unreadable file is a usage error, not a crash
        parser.exit(2, f"batch-dagster: error: {exc.strerror or exc}: {exc.filename or ''}\n")
    # Only as the command itself (argv from the command line): Python code calling main() keeps its process.
    if argv is None and getattr(args, "exit_at_once", False):
        _exit_at_once(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
