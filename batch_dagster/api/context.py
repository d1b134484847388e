"""What every API request shares: the settings, the metadata store, the batch folders, the owners of the keys."""

from __future__ import annotations

from dataclasses import dataclass

from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import Database
from batch_dagster.db.repo import owner_of_key
from batch_dagster.egress import Allow
from batch_dagster.settings import Settings, split_key


@dataclass
class AppContext:
    config: Settings  # keys, store, body limits, completion window
    db: Database  # the metadata store
    storage: Storage  # where batch folders and files live
    owners: dict[str, str]  # api key -> owner (its hash, whatever its name: stored rows keep their owner)
    webhook_allow: Allow  # internal hosts keys' webhook endpoints may reach (BATCH_WEBHOOK_ALLOW)

    @classmethod
    def build(cls, config: Settings) -> AppContext:
        owners = {key: owner_of_key(key) for _, key in map(split_key, config.api_keys)}
        return cls(config, Database(config.database_url), config.storage(), owners, Allow.parse(config.webhook_allow))
