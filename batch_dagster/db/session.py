"""A database URL -> engine, sessions and the schema upgraded to head with Alembic."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from batch_dagster.storage.local import FILE_MODE, private_folder

log = logging.getLogger("batch_dagster.db")
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    if url.startswith("sqlite:///") and ":memory:" not in url:
        _private_file(Path(url.removeprefix("sqlite:///")))
    # The API's worker threads and the Dagster sensors share one file: wait for locks, never fail on them.
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def _private_file(path: Path) -> None:
    """Create the SQLite store's file for its user alone (0600, whatever the umask: it keeps webhook secrets and
    every key's batches); SQLite gives its -wal and -shm files the same mode. A store that exists is left as it is,
    with a warning when other users may read it."""
    private_folder(path.parent)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        os.chmod(path, FILE_MODE)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            log.warning("the store %s may be read by other users (mode %o): `chmod 600` it and its -wal and -shm "
                        "files", path, path.stat().st_mode & 0o777)


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


class Database:
    """One database: its engine, a session factory, and `upgrade()` to the newest schema."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def upgrade(self) -> None:
        """Apply the Alembic migrations up to head (idempotent)."""
        from alembic import command

        cfg = alembic_config(self.url)
        with self.engine.begin() as connection:
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, "head")

    def revision(self, message: str) -> None:
        """Write a new migration from the difference between the models and this database, upgraded to head first."""
        from alembic import command

        self.upgrade()
        command.revision(alembic_config(self.url), message=message, autogenerate=True)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as session:
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


_lock = threading.Lock()


@functools.cache
def _upgraded_store(url: str) -> Database:
    store = Database(url)
    store.upgrade()
    return store


def open_database(url: str) -> Database:
    """The process-wide store for `url`, upgraded once on first use."""
    with _lock:
        return _upgraded_store(url)
