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
