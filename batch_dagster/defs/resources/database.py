"""The API's metadata store as a Dagster resource, for the sensors and assets that read and write batches, and the
keys whose owners it holds (for the owners' names in run tags, and the owner of dropped files)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.db import keys
from batch_dagster.db.repo import ANONYMOUS, owner_of_key
from batch_dagster.db.session import Database, open_database
from batch_dagster.defs.run_tags import OwnerLabels
from batch_dagster.settings import api_key_entries, split_key

from .setting_fields import setting


class DatabaseResource(dg.ConfigurableResource):
    """The API's metadata store at `url` (any SQLAlchemy URL), upgraded to the newest schema on first use.

    `url` may carry a password, and the keys are secrets: set, they reach it as `dg.EnvVar`s (fields.from_settings),
    so the Dagster UI shows the variables' names, never their values.
    """

    url: str = setting("BATCH_DATABASE_URL")  # empty: no store (step_session)
    api_keys: str = setting("BATCH_API_KEYS", as_text=True)  # its `name:key` or `key` entries, parsed when used
    intake_api_key: str = setting("BATCH_INTAKE_API_KEY")  # empty: see intake_owner

    def database(self) -> Database:
        return open_database(self.url)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.database().session() as session:
            yield session

    @contextmanager
    def step_session(self) -> Iterator[Session | None]:
        """A step's one session of the store; None without a store (`url` empty: definitions with none, the fast
        tests'), for the steps that use it only when there is one (the token limit, the cost cap, the estimate)."""
        if not self.url:
            yield None
            return
        with self.session() as session:
            yield session

    def labels(self) -> OwnerLabels:
        """How the owners are shown in run tags: the names the store keeps for their keys (db/keys.py: the same the
        metrics show), else BATCH_API_KEYS' names, else a keyed hash."""
        labels = OwnerLabels.of(map(split_key, api_key_entries(self.api_keys)), self.intake_api_key)
        if not self.url:
            return labels
        with self.session() as session:
            stored = {owner: name for owner, name in keys.labels(session).items() if name != keys.UNNAMED}
        return OwnerLabels({**labels.names, **stored}, labels.secret)

    def intake_owner(self) -> str:
        """The owner dropped files' batches belong to: BATCH_INTAKE_API_KEY's (its owner in the store, whose key may
        have been rotated since); with API keys (in BATCH_API_KEYS or the store) and none chosen, "" (the drop
        sensors then take no file: never a key picked for the operator); with no keys, the keyless one."""
        keyed = bool(api_key_entries(self.api_keys))
        if self.url:
            with self.session() as session:
                if self.intake_api_key:
                    caller = keys.authenticate(session, self.intake_api_key)
                    return caller.owner if caller is not None else owner_of_key(self.intake_api_key)
                keyed = keyed or keys.keyed(session)
        if self.intake_api_key:
            return owner_of_key(self.intake_api_key)
        return "" if keyed else ANONYMOUS

    def no_intake_owner(self) -> str | None:
        """Why the drop sensors take no file (no owner chosen for them), or None."""
        if self.intake_owner():
            return None
        return ("Dropped files are left where they are: the API has keys (BATCH_API_KEYS or `batch-dagster keys`) but "
                "BATCH_INTAKE_API_KEY is not set. Set it to the key whose owner the dropped files' batches belong to.")
