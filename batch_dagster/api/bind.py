"""The rule that an API without keys stays on loopback."""

from __future__ import annotations

import ipaddress
import logging

from batch_dagster.settings import Settings

log = logging.getLogger("batch_dagster.api")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class UnsafeBind(SystemExit):
    """Refusing to serve an API without keys on a non-loopback address."""


def check_bind(host: str, config: Settings) -> None:
    """Without API keys the API has no authentication, so it may only listen on loopback. Keys are those of
    BATCH_API_KEYS and those the store holds (`batch-dagster keys`): the store is brought to its newest schema here
    to ask it."""
    if config.api_keys:
        log.info("API keys: %d configured; every request needs `Authorization: Bearer <key>`", len(config.api_keys))
        return
    if _store_is_keyed(config.database_url):
        log.info("API keys: in the store (batch-dagster keys); every request needs `Authorization: Bearer <key>`")
        return
    if not is_loopback(host):
        message = (f"No API keys (BATCH_API_KEYS is unset and the store holds none): refusing to listen on {host}, "
                   "which is not a loopback address. Set BATCH_API_KEYS, or create a key with `batch-dagster keys "
                   "create NAME`, to serve other machines.")
        log.error(message)
        raise UnsafeBind(message)
    log.warning("No API keys (BATCH_API_KEYS is unset and the store holds none): no authentication; listening on "
                "loopback (%s) only", host)


def _store_is_keyed(url: str) -> bool:
    from batch_dagster.db import Database, keys

    store = Database(url)
    try:
        store.upgrade()
        with store.session() as session:
            return keys.keyed(session)
    finally:
        store.dispose()
