"""The store as a Dagster resource, for the sensors that hand API batches to the pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.settings import Settings

from .session import Store, database_url_from_env, open_store


class ApiStore(dg.ConfigurableResource):
    """The API's metadata store at `url` (any SQLAlchemy URL), upgraded to the newest schema on first use."""

    url: str

    def store(self) -> Store:
        return open_store(self.url)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.store().session() as session:
            yield session


def api_store_from_env() -> ApiStore:
    return ApiStore(url=database_url_from_env(Settings.from_env().data_dir))
