"""What every API request shares: the settings, the metadata store, the batch folders."""

from __future__ import annotations

from dataclasses import dataclass

from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import Database
from batch_dagster.egress import Allow
from batch_dagster.settings import Settings


@dataclass
class AppContext:
    config: Settings  # the keys' default limits, the store, body limits, completion window
    db: Database  # the metadata store: its API keys too (db/keys.py)
    storage: Storage  # where batch folders and files live
    webhook_allow: Allow  # internal hosts keys' webhook endpoints may reach (BATCH_WEBHOOK_ALLOW)
    keyed: bool = False  # the store has held a key: every /v1 request needs one (once True, it stays so)

    @classmethod
    def build(cls, config: Settings) -> AppContext:
        return cls(config, Database(config.database_url), config.storage(), Allow.parse(config.webhook_allow))
