"""What every API request shares: the settings, the metadata store, the batch folders, the lanes of slow work."""

from __future__ import annotations

from dataclasses import dataclass, field

from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import Database
from batch_dagster.features.egress import Allow
from batch_dagster.features.estimate import Counted
from batch_dagster.settings import Settings

from .lanes import Kept, Lane
from .launch_nudge import LaunchNudge
from .uploads import UploadSlots

# An estimate validates and counts a whole file (up to the upload limit, each body rendered by the count worker,
# engine/counting.py): the CPU's work, so few threads; one of a key's files at a time, a few more waiting, so one key
# never holds the lane; and a bound across keys, since each estimate waiting holds its request (and many keys are
# many floods). Each count stops at BATCH_ESTIMATE_TIMEOUT_S.
ESTIMATE_WORKERS, ESTIMATE_PER_KEY, ESTIMATES_QUEUED_PER_KEY, ESTIMATES_QUEUED = 2, 1, 8, 32
KEPT_COUNTS = 256  # files whose count is kept: a File's bytes never change, so its count never does
# A webhook endpoint's host is resolved when it is created: a slow resolver must hold no thread of the API's.
LOOKUP_WORKERS, LOOKUPS_PER_KEY, LOOKUPS_QUEUED_PER_KEY, LOOKUPS_QUEUED = 4, 2, 4, 64


@dataclass
class AppContext:
    config: Settings  # the keys' default limits, the store, body limits, completion window
    db: Database  # the metadata store: its API keys too (db/keys.py)
    storage: Storage  # where batch folders and files live
    webhook_allow: Allow  # internal hosts keys' webhook endpoints may reach (BATCH_WEBHOOK_ALLOW)
    keyed: bool = False  # the store has held a key: every /v1 request needs one (once True, it stays so)
    estimates: Lane = field(default_factory=lambda: Lane(
        "estimates", workers=ESTIMATE_WORKERS, per_key=ESTIMATE_PER_KEY, queued_per_key=ESTIMATES_QUEUED_PER_KEY,
        queued=ESTIMATES_QUEUED, what="estimates"))
    counts: Kept[Counted] = field(default_factory=lambda: Kept(KEPT_COUNTS))  # by (file id, endpoint)
    lookups: Lane = field(default_factory=lambda: Lane(
        "webhook_lookups", workers=LOOKUP_WORKERS, per_key=LOOKUPS_PER_KEY, queued_per_key=LOOKUPS_QUEUED_PER_KEY,
        queued=LOOKUPS_QUEUED, what="webhook endpoint creations"))
    uploads: UploadSlots = field(default_factory=UploadSlots)  # streaming in, per key (BATCH_KEY_MAX_UPLOADS)
    launches: LaunchNudge = field(default_factory=lambda: LaunchNudge(None))  # serve's daemon, told of new batches

    def close(self) -> None:
        self.estimates.close()
        self.lookups.close()
        self.db.dispose()

    @classmethod
    def build(cls, config: Settings) -> AppContext:
        return cls(config, Database(config.database_url), config.storage(), Allow.parse(config.webhook_allow))
