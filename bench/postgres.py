"""A throwaway PostgreSQL 15 server on loopback for the load test and the tests: initdb, start, stop, delete.

The server binaries are looked for in PG_BIN, then /usr/lib/postgresql/15/bin, then on PATH. PostgreSQL refuses
to run as root, so as root the data directory is handed to the `postgres` user and the server runs as it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_VERSION_BIN = Path("/usr/lib/postgresql/15/bin")


def pg_bin() -> Path | None:
    """The folder holding initdb and pg_ctl, or None when PostgreSQL's server is not installed."""
    for candidate in (os.environ.get("PG_BIN"), PG_VERSION_BIN):
        if candidate and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TempPostgres:
    """`with TempPostgres() as pg: pg.url` is a SQLAlchemy URL (psycopg 3) of an empty database."""

    def __init__(self, bin_dir: Path | None = None):
        found = bin_dir or pg_bin()
        if found is None:
            raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found; set PG_BIN")
        self.bin: Path = found
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="batch-pg-"))
        self.data = self.dir / "data"
        self.as_postgres = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)

    def __enter__(self) -> TempPostgres:
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self._run("pg_ctl", "-D", str(self.data), "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200",
                  "-l", str(self.dir / "postgres.log"), "-w", "start")
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        except (subprocess.SubprocessError, OSError):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
