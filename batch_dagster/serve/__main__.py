"""`make serve`: the API, the Dagster UI and the Dagster daemon (which runs the sensors), and a warm fleet per model
of BATCH_FLEET_MODELS, stopped together. It writes where Prometheus finds what it runs to
$BATCH_DATA_DIR/prometheus/targets.json (a file_sd_config's file): the API's metrics listener (loopback, a port of
its own, never the API's), each fleet's router exporter and replicas.

Each child runs in its own process group. Ctrl-C (SIGINT) or SIGTERM stops them all: SIGINT to each
group, a grace period, then SIGKILL to whatever is left in the groups, so no child outlives serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batch_dagster.db import Database
from batch_dagster.serve.fleet import free_port_block
from batch_dagster.serve.fleets import WarmFleets, scrape_targets, write_targets
from batch_dagster.serve.processes import Children
from batch_dagster.settings import LOOPBACK, Settings

log = logging.getLogger("batch_dagster.serve")


def _workspace_args() -> list[str]:
    workspace = Path.cwd() / "workspace.yaml"
    return ["-w", str(workspace)] if workspace.exists() else ["-m", "batch_dagster.definitions"]


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m batch_dagster.serve", description=__doc__)
    parser.add_argument("--host", default=settings.api_host, help="the API's address")
    parser.add_argument("--port", type=int, default=settings.api_port)
    parser.add_argument("--metrics-host", default=settings.metrics_host, help="the address of the API's metrics "
                        "listener (the operator's: loopback unless BATCH_METRICS_HOST says otherwise)")
    parser.add_argument("--metrics-port", type=int, default=settings.metrics_port,
                        help="its port; 0 (the default): a free one, logged and written to the Prometheus targets")
    parser.add_argument("--dagster-host", default=LOOPBACK, help="the Dagster UI's address")
    parser.add_argument("--dagster-port", type=int, default=3000)
    parser.add_argument("--no-ui", action="store_true", help="run the API and the daemon only")
    parser.add_argument("--no-fleet", action="store_true", help="no warm fleets: every batch runs offline in its "
                        "run (as BATCH_FLEET_REPLICAS=0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    config = Settings.from_env()
    args = build_parser(config).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)

    from batch_dagster.api.bind import UnsafeBind, check_bind
    from batch_dagster.defs.instance import ensure_dagster_home

    try:
        check_bind(args.host, config)
    except UnsafeBind:
        return 2
    if config.api_keys and not config.intake_api_key:
        log.warning("BATCH_API_KEYS is set but BATCH_INTAKE_API_KEY is not: the drop folders (inbox, S3) take no "
                    "file until it names the key that owns dropped files' batches")
    try:
        home = ensure_dagster_home(config)
    except ValueError as exc:  # a run limit below 1
        log.error("%s", exc)
        return 2
    # Create the instance's SQLite storages here, once (Dagster's own command, so serve loads no Dagster): the
    # daemon and the webserver creating them at the same moment on a fresh DAGSTER_HOME stamp their Alembic
    # version twice and then refuse to load.
    subprocess.run([str(Path(sys.executable).parent / "dagster"), "instance", "info"], check=True,
                   env={**os.environ, "DAGSTER_HOME": str(home)}, stdout=subprocess.DEVNULL)
    # Create or upgrade the schema once, before the API and the daemon's sensors both open the store.
    store = Database(config.database_url)
    store.upgrade()
    store.dispose()

    env = {**os.environ, "DAGSTER_HOME": str(home)}
    scripts = Path(sys.executable).parent
    target = _workspace_args()
    children = Children()
    stopping: list[int] = []

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)

    try:
        fleets = None if args.no_fleet else _fleets(config, Database(config.database_url))
    except ValueError as exc:  # more replicas than the GPUs go round
        log.error("%s", exc)
        return 2
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rc = 0
    metrics_port = args.metrics_port or free_port_block(1, args.metrics_host)
    # The socket on which the API tells the daemon of each batch it creates (api/launch_nudge.py), in a folder only
    # this user can enter; short, as a Unix socket's path must be (108 bytes).
    nudges = tempfile.mkdtemp(prefix="batch-dagster-")
    launch_nudge = os.path.join(nudges, "launch.sock")
    try:
        children.start("api", [sys.executable, "-m", "batch_dagster.api", "--host", args.host, "--port",
                               str(args.port), "--metrics-host", args.metrics_host, "--metrics-port",
                               str(metrics_port), "--launch-nudge", launch_nudge], env)
        if fleets is not None:
            # Warm before the daemon starts: no run waits on an engine start, none meets a fleet half up.
            fleets.start(should_stop=lambda: bool(stopping))
            env["BATCH_FLEET_URLS"] = ",".join(f"{model}={url}" for model, url in fleets.urls().items())
            if fleets.spare_gpus is not None:
                # The runs of models without a fleet hold their engine in their own process: only on GPUs the
                # fleets left, never on a replica's (their engine would not fit beside it).
                env["CUDA_VISIBLE_DEVICES"] = ",".join(fleets.spare_gpus)
                log.info("runs of other models see GPU(s) %s", env["CUDA_VISIBLE_DEVICES"] or "none")
        metrics_target = f"{_scrape_host(args.metrics_host)}:{metrics_port}"
        write_targets(config.data_dir / "prometheus" / "targets.json",
                      scrape_targets(metrics_target, fleets.fleets if fleets else {}))
        # Dagster's daemon, looking for due sensors every BATCH_SENSOR_LOOP_S (batch_dagster/defs/daemon.py).
        children.start("dagster-daemon", [sys.executable, "-m", "batch_dagster.defs.daemon", str(config.sensor_loop_s),
                                          launch_nudge, "run", *target], env)
        if not args.no_ui:
            children.start("dagster-webserver", [str(scripts / "dagster-webserver"), "-h", args.dagster_host,
                                                 "-p", str(args.dagster_port), *target], env)
        ui = "" if args.no_ui else f"; Dagster UI on http://{args.dagster_host}:{args.dagster_port}"
        log.info("API on http://%s:%d/v1 (its metrics on http://%s:%d/metrics)%s; DAGSTER_HOME=%s; Ctrl-C stops "
                 "everything", args.host, args.port, args.metrics_host, metrics_port, ui, home)
        while not stopping:
            if fleets is not None:
                fleets.tick()  # the fleets' processes are restarted, idle ones sleep; serve's own three are not
            if dead := children.exited():
                log.error("%s exited unexpectedly; stopping the rest", ", ".join(dead))
                rc = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:  # stopped while the fleets were starting
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children.stop()
        shutil.rmtree(nudges, ignore_errors=True)
        if fleets is not None:
            fleets.stop()
        log.info("stopped")
    return rc


def _scrape_host(host: str) -> str:
    """Where a Prometheus on this machine reaches the API's metrics bound to `host`."""
    return LOOPBACK if host in ("0.0.0.0", "::", "") else host


def _fleets(settings: Settings, store: Database) -> WarmFleets | None:
    """The warm fleets `make serve` runs (BATCH_FLEET_*), or None when it runs none. A model of BATCH_FLEET_MODELS
    that the registry does not have gets none, said in the log; serve runs on."""
    models, unknown = settings.served_fleet_models()
    for model in unknown:
        log.error("BATCH_FLEET_MODELS names %r, which is not in the registry (%s): no fleet for it; its batches are "
                  "refused at validation", model, settings.models_file)
    if settings.fleet_replicas <= 0 or not models:
        return None
    return WarmFleets.plan(settings, models, host=LOOPBACK, store=store)


if __name__ == "__main__":
    sys.exit(main())
