"""`make serve`: the API, the Dagster UI and the Dagster daemon (which runs the sensors), stopped together.

Each child runs in its own process group. Ctrl-C (SIGINT) or SIGTERM stops them all: SIGINT to each
group, a grace period, then SIGKILL to whatever is left in the groups, so no child outlives serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from batch_dagster.settings import Settings

log = logging.getLogger("batch_dagster.serve")
GRACE_S = 20.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Children:
    """Child processes, each the leader of its own process group."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        log.info("starting %s: %s", name, " ".join(command))
        self.procs[name] = subprocess.Popen(command, env=env, start_new_session=True)
        log.info("%s has pid %d", name, self.procs[name].pid)

    def exited(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, grace_s: float = GRACE_S) -> None:
        """SIGINT every group, wait for every member to go, then SIGKILL the groups still there."""
        for name, proc in self.procs.items():
            log.info("stopping %s (process group %d)", name, proc.pid)
            _signal_group(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                proc.poll()
            if not any(_group_alive(p.pid) for p in self.procs.values()):
                break
            time.sleep(0.2)
        for name, proc in self.procs.items():
            if _group_alive(proc.pid):
                log.warning("%s did not stop within %.0fs; killing its process group", name, grace_s)
                _signal_group(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                log.error("pid %d did not exit after SIGKILL", proc.pid)


def _workspace_args() -> list[str]:
    workspace = Path.cwd() / "workspace.yaml"
    return ["-w", str(workspace)] if workspace.exists() else ["-m", "batch_dagster.definitions"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m batch_dagster.serve", description=__doc__)
    settings = Settings.from_env()
    parser.add_argument("--host", default=settings.api_host, help="the API's address")
    parser.add_argument("--port", type=int, default=settings.api_port)
    parser.add_argument("--dagster-host", default="127.0.0.1", help="the Dagster UI's address")
    parser.add_argument("--dagster-port", type=int, default=3000)
    parser.add_argument("--no-ui", action="store_true", help="run the API and the daemon only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)

    from batch_dagster.api.bind import UnsafeBind, check_bind
    from batch_dagster.api.context import ApiConfig
    from batch_dagster.instance import ensure_dagster_home
    from batch_dagster.store import Store

    config = ApiConfig.from_settings()
    try:
        check_bind(args.host, config)
    except UnsafeBind:
        return 2
    home = ensure_dagster_home()
    # Create the instance's SQLite storages here, once: the daemon and the webserver creating them at the
    # same moment on a fresh DAGSTER_HOME stamp their Alembic version twice and then refuse to load.
    import dagster as dg

    with dg.DagsterInstance.get():
        pass
    # Create or upgrade the schema once, before the API and the daemon's sensors both open the store.
    store = Store(config.database_url)
    store.upgrade()
    store.dispose()

    env = {**os.environ, "DAGSTER_HOME": str(home)}
    scripts = Path(sys.executable).parent
    target = _workspace_args()
    children = Children()
    stopping: list[int] = []

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rc = 0
    try:
        children.start("api", [sys.executable, "-m", "batch_dagster.api", "--host", args.host, "--port",
                               str(args.port)], env)
        children.start("dagster-daemon", [str(scripts / "dagster-daemon"), "run", *target], env)
        if not args.no_ui:
            children.start("dagster-webserver", [str(scripts / "dagster-webserver"), "-h", args.dagster_host,
                                                 "-p", str(args.dagster_port), *target], env)
        ui = "" if args.no_ui else f"; Dagster UI on http://{args.dagster_host}:{args.dagster_port}"
        log.info("API on http://%s:%d/v1%s; DAGSTER_HOME=%s; Ctrl-C stops everything",
                 args.host, args.port, ui, home)
        while not stopping:
            if dead := children.exited():
                log.error("%s exited unexpectedly; stopping the rest", ", ".join(dead))
                rc = 1
                break
            time.sleep(0.5)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children.stop()
        log.info("stopped")
    return rc


if __name__ == "__main__":
    sys.exit(main())
