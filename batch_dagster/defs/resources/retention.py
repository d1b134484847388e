"""How long a batch's history is kept and how many batches keep one, as a Dagster resource
(BATCH_HISTORY_RETENTION_S, BATCH_HISTORY_MAX_BATCHES, BATCH_SCRATCH_MAX_AGE_S)."""

from __future__ import annotations

import dagster as dg

from .fields import setting


class Retention(dg.ConfigurableResource):
    """Seconds after its end at which a batch's Dagster history and working files go (0: never), the most batch
    partitions kept (0: no bound), and the age past which leftover scratch files and staged step logs are swept."""

    history_retention_s: int = setting("BATCH_HISTORY_RETENTION_S")
    history_max_batches: int = setting("BATCH_HISTORY_MAX_BATCHES")
    scratch_max_age_s: int = setting("BATCH_SCRATCH_MAX_AGE_S")
