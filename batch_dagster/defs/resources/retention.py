"""How long a batch's history is kept, as a Dagster resource (BATCH_HISTORY_RETENTION_S, BATCH_SCRATCH_MAX_AGE_S)."""

from __future__ import annotations

import dagster as dg

from batch_dagster import settings as s

from .pipeline import env_or


class Retention(dg.ConfigurableResource):
    """Seconds after its end at which a batch's Dagster history and working files go (0: never), and the age past
    which leftover scratch files and staged step logs are swept."""

    history_retention_s: int = s.default("BATCH_HISTORY_RETENTION_S")
    scratch_max_age_s: int = s.default("BATCH_SCRATCH_MAX_AGE_S")


def retention_from_env(settings: s.Settings) -> Retention:
    return Retention(history_retention_s=env_or("BATCH_HISTORY_RETENTION_S", settings.history_retention_s),
                     scratch_max_age_s=env_or("BATCH_SCRATCH_MAX_AGE_S", settings.scratch_max_age_s))
