"""The API's metadata store as a Dagster resource, for the sensors and assets that read and write batches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.db.session import Database, open_database


class DatabaseResource(dg.ConfigurableResource):
    """The API's metadata store at `url` (any SQLAlchemy URL), upgraded to the newest schema on first use."""

    url: str

    def database(self) -> Database:
        return open_database(self.url)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.database().session() as session:
            yield session
