"""The API's configuration (from the settings) and what every request shares: config, store, batch folders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import Database
from batch_dagster.db.repo import owner_of_key
from batch_dagster.egress import Allow
from batch_dagster.settings import Settings


@dataclass(frozen=True)
class ApiConfig:
    """What the API needs of the settings: keys, store, data dir, body limits, completion window."""

    api_keys: tuple[str, ...]
    database_url: str
    data_dir: Path
    max_upload_bytes: int
    completion_window_s: int
    max_json_body_bytes: int = 1 << 20
    storage_url: str = ""  # where batch folders and files live; empty: data_dir
    webhook_allow: Allow = Allow()  # internal hosts keys' webhook endpoints may reach (BATCH_WEBHOOK_ALLOW)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> ApiConfig:
        settings = settings or Settings.from_env()
        return cls(api_keys=settings.api_keys, database_url=settings.database_url, data_dir=settings.data_dir,
                   storage_url=settings.storage_url,
                   max_upload_bytes=settings.max_upload_bytes, completion_window_s=settings.completion_window_s,
                   max_json_body_bytes=settings.max_json_body_bytes,
                   webhook_allow=Allow.parse(settings.webhook_allow))

    def storage(self) -> Storage:
        from batch_dagster.storage import open_storage

        return open_storage(self.storage_url or str(self.data_dir), self.data_dir / "scratch")


@dataclass
class AppContext:
    config: ApiConfig
    db: Database  # the metadata store
    storage: Storage  # where batch folders and files live
    owners: dict[str, str]  # api key -> owner

    @classmethod
    def build(cls, config: ApiConfig) -> AppContext:
        return cls(config, Database(config.database_url), config.storage(),
                   {key: owner_of_key(key) for key in config.api_keys})
