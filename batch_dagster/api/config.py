"""The API's configuration from the environment, and the rule that an open API stays on loopback."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from batch_dagster.settings import Settings, api_keys_from_env
from batch_dagster.store.session import database_url_from_env

log = logging.getLogger("batch_dagster.api")

DEFAULT_COMPLETION_WINDOW_S = 24 * 3600


@dataclass(frozen=True)
class ApiConfig:
    """BATCH_API_KEYS, BATCH_DATABASE_URL, BATCH_DATA_DIR, BATCH_MAX_UPLOAD_BYTES, BATCH_COMPLETION_WINDOW_S."""

    api_keys: tuple[str, ...]
    database_url: str
    data_dir: Path
    max_upload_bytes: int
    completion_window_s: int

    @classmethod
    def from_env(cls) -> ApiConfig:
        settings = Settings.from_env()
        keys = api_keys_from_env()
        return cls(
            api_keys=keys,
            database_url=database_url_from_env(settings.data_dir),
            data_dir=settings.data_dir,
            max_upload_bytes=int(os.environ.get("BATCH_MAX_UPLOAD_BYTES") or settings.limits.max_bytes),
            completion_window_s=int(os.environ.get("BATCH_COMPLETION_WINDOW_S") or DEFAULT_COMPLETION_WINDOW_S),
        )

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class UnsafeBind(SystemExit):
    """Refusing to serve an API without keys on a non-loopback address."""


def check_bind(host: str, config: ApiConfig) -> None:
    """Without API keys the API has no authentication, so it may only listen on loopback."""
    if config.api_keys:
        log.info("API keys: %d configured; every request needs `Authorization: Bearer <key>`", len(config.api_keys))
        return
    if not is_loopback(host):
        message = (f"BATCH_API_KEYS is unset: refusing to listen on {host}, which is not a loopback address. "
                   "Set BATCH_API_KEYS (comma-separated keys) to serve other machines.")
        log.error(message)
        raise UnsafeBind(message)
    log.warning("BATCH_API_KEYS is unset: no authentication; listening on loopback (%s) only", host)
