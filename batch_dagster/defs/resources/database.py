"""The API's metadata store as a Dagster resource, for the sensors and assets that read and write batches, and the
keys whose owners it holds (for the owners' labels in run tags)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.db.labels import OwnerLabels
from batch_dagster.db.repo import ANONYMOUS, owner_of_key
from batch_dagster.db.session import Database, open_database
from batch_dagster.settings import api_key_entries, first_key, split_key


class DatabaseResource(dg.ConfigurableResource):
    """The API's metadata store at `url` (any SQLAlchemy URL), upgraded to the newest schema on first use.

    `url` may carry a password, and the keys are secrets: database_from_env gives them as `dg.EnvVar`s, so the
    Dagster UI shows the variables' names, never their values.
    """

    url: str
    api_keys: str = ""  # BATCH_API_KEYS: `name:key` or `key` entries
    intake_api_key: str = ""  # BATCH_INTAKE_API_KEY; empty: the first of api_keys

    def database(self) -> Database:
        return open_database(self.url)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.database().session() as session:
            yield session

    def labels(self) -> OwnerLabels:
        """How the owners are shown in run tags: the keys' names, else a keyed hash."""
        return OwnerLabels.of(map(split_key, api_key_entries(self.api_keys)), self.intake_api_key)

    def intake_owner(self) -> str:
        """The owner dropped files' batches are listed under: BATCH_INTAKE_API_KEY's, else the first key's."""
        key = self.intake_api_key or first_key(api_key_entries(self.api_keys))
        return owner_of_key(key) if key else ANONYMOUS
