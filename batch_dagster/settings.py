"""Configuration from the environment, in one place, with defaults that work on a laptop."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from batch_dagster.batchfile.contract import Limits

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "config"


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def api_keys_from_env() -> tuple[str, ...]:
    """BATCH_API_KEYS: the comma-separated keys of the API (empty: no authentication, loopback only)."""
    return tuple(k.strip() for k in os.environ.get("BATCH_API_KEYS", "").split(",") if k.strip())


@dataclass(frozen=True)
class Settings:
    """Where data lives, which config files apply, and the batch limits."""

    data_dir: Path
    model_cache_dir: Path
    models_file: Path
    prices_file: Path
    limits: Limits
    shard_size: int

    @classmethod
    def from_env(cls) -> Settings:
        data_dir = Path(os.environ.get("BATCH_DATA_DIR") or Path.cwd() / "data").resolve()
        return cls(
            data_dir=data_dir,
            model_cache_dir=Path(os.environ.get("BATCH_MODEL_CACHE") or data_dir / "models"),
            models_file=Path(os.environ.get("BATCH_MODELS_FILE") or CONFIG_DIR / "models.toml"),
            prices_file=Path(os.environ.get("BATCH_PRICES_FILE") or CONFIG_DIR / "prices.toml"),
            limits=Limits(
                max_requests=_int("BATCH_MAX_REQUESTS", Limits.max_requests),
                max_bytes=_int("BATCH_MAX_BYTES", Limits.max_bytes),
                max_line_bytes=_int("BATCH_MAX_LINE_BYTES", Limits.max_line_bytes),
            ),
            shard_size=_int("BATCH_SHARD_SIZE", 1000),
        )
