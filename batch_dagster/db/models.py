"""The tables: API keys (by hash), files and batches, named as in the OpenAI File and Batch objects.

Rows have an integer `pk` that orders them (list pagination) and the public `id` the API shows.
Only portable types are used, so the same schema runs on SQLite and Postgres.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from batch_dagster.batchfile.contract import (
    MAX_FILENAME_CHARS,
    MAX_MODEL_CHARS,
    MAX_SOURCE_CHARS,
    MAX_VERSION_CHARS,
    RequestCounts,
)
from batch_dagster.batchfile.options import BatchOptions, BatchRequest
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.windows import NO_WINDOW, Window

# SQLite only auto-increments an INTEGER PRIMARY KEY; elsewhere the key is a BIGINT.
PK = BigInteger().with_variant(Integer(), "sqlite")

__all__ = ["TERMINAL"]  # re-exported: the store's modules import it from here


class Base(DeclarativeBase):
    type_annotation_map = {int: BigInteger, dict[str, Any]: JSON, list[dict[str, Any]]: JSON}


class ApiKey(Base):
    """An owner of files and batches, and the API key it calls with (by its SHA-256: the key itself is never stored).

    `owner` never changes: it is what the owner's rows are stored under (the hash of its first key). A rotation
    gives it a new key (`key_hash`); a revoked key (`revoked_at`) is refused from its next request on. Each limit
    is the key's own, or the deployment's (BATCH_KEY_*) when NULL; 0 is no limit. An owner with no key_hash calls
    with no key: the keyless loopback owner, or one whose key is gone.
    """

    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_name", "name", unique=True),
                      Index("ix_api_keys_key_hash", "key_hash", unique=True))

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[int]
    name: Mapped[str | None] = mapped_column(String(64))  # the operator's name for it (metrics, the UI)
    key_hash: Mapped[str | None] = mapped_column(String(64))
    admin: Mapped[bool] = mapped_column(default=False, server_default="0")  # may manage keys (/v1/keys)
    created_by: Mapped[str | None] = mapped_column(String(32))  # `cli`, `api` or BATCH_API_KEYS (seeded)
    revoked_at: Mapped[int | None]
    rotated_at: Mapped[int | None]
    max_active_batches: Mapped[int | None]
    max_stored_bytes: Mapped[int | None]
    daily_budget: Mapped[float | None] = mapped_column(Float)
    max_priority: Mapped[int | None] = mapped_column(Integer)


class FileRecord(Base):
    """A File object; its bytes live at `path` (uploads under the data dir, outputs in the batch's folder)."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_owner_pk", "owner", "pk"),)

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(64), ForeignKey("api_keys.owner"))
    bytes: Mapped[int]
    created_at: Mapped[int]
    expires_at: Mapped[int | None]
    filename: Mapped[str] = mapped_column(String(MAX_FILENAME_CHARS))
    purpose: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    batch_id: Mapped[str | None] = mapped_column(String(64))  # the batch that wrote an output file


# A Batch object's timestamps, as OpenAI's lists them.
TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")


def priced_window(completion_window: str, expires_at: int | None) -> str | None:
    """BatchRecord.window, from its two columns (as a query reads them)."""
    return completion_window if expires_at is not None else None


class BatchRecord(Base):
    """A Batch object and how far the API has handed it to Dagster (`launched_at`)."""

    __tablename__ = "batches"
    # On PostgreSQL the metadata is jsonb with a GIN index, which a list's metadata filter (`@>`) reads instead of
    # the key's whole history; SQLite keeps JSON text (a plain index there, never read) and scans.
    __table_args__ = (Index("ix_batches_owner_pk", "owner", "pk"), Index("ix_batches_status", "status"),
                      Index("ix_batches_metadata", "metadata", postgresql_using="gin",
                            postgresql_ops={"metadata": "jsonb_path_ops"}))

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(64), ForeignKey("api_keys.owner"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))  # a BatchStatus value
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[int]
    in_progress_at: Mapped[int | None]
    expires_at: Mapped[int | None]
    finalizing_at: Mapped[int | None]
    completed_at: Mapped[int | None]
    failed_at: Mapped[int | None]
    expired_at: Mapped[int | None]
    cancelling_at: Mapped[int | None]
    cancelled_at: Mapped[int | None]
    request_total: Mapped[int] = mapped_column(default=0)
    request_completed: Mapped[int] = mapped_column(default=0)
    request_failed: Mapped[int] = mapped_column(default=0)
    request_incomplete_structured: Mapped[int] = mapped_column(default=0, server_default="0")
    request_invalid_structured: Mapped[int] = mapped_column(default=0, server_default="0")
    # "metadata" is reserved on declarative classes; the column keeps the API's name.
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON().with_variant(JSONB(), "postgresql"))
    model: Mapped[str | None] = mapped_column(String(MAX_MODEL_CHARS))
    usage: Mapped[dict[str, Any] | None]
    errors: Mapped[list[dict[str, Any]] | None]
    output_expires_after: Mapped[int | None]  # seconds; applied to the output and error files
    launched_at: Mapped[int | None]
    run_id: Mapped[str | None] = mapped_column(String(64))
    # The batch this one retries: set by the retry endpoint only (never from client metadata), same owner.
    parent_batch_id: Mapped[str | None] = mapped_column(String(64))
    # Its options (batchfile/options.py), kept whole: those that differ from their defaults (`options` reads them).
    stored_options: Mapped[dict[str, Any] | None] = mapped_column("options", JSON)
    # Queue position and ETA (features/eta.py): the estimate once validated; the run's dagster/priority once
    # launched; the place and end the daemon's queue_eta_sensor stores while the batch has not ended.
    estimate: Mapped[dict[str, Any] | None]
    launch_priority: Mapped[int | None]
    # The bytes of its folder no File row counts (its own copy of its input, its working files): what its key keeps
    # beside its files (features/quotas.py). Its input copy's size at creation; its folder measured once it has ended,
    # and again after retention.
    stored_bytes: Mapped[int] = mapped_column(default=0)
    queue_position: Mapped[int | None]
    estimated_completion_at: Mapped[int | None]
    # When the queue first estimated that the batch will end after expires_at (features/eta.py): its
    # batch.deadline_at_risk event is written in the same transaction, once.
    deadline_at_risk_at: Mapped[int | None]
    # The first estimated end it was given: what the ETA's error on ended batches is measured against (metrics).
    first_estimated_completion_at: Mapped[int | None]

    @property
    def window(self) -> str | None:
        """The completion window that prices the batch (usage.PriceTable); None for one with no deadline (the command
        line's), whose `completion_window` only shows OpenAI's default."""
        return priced_window(self.completion_window, self.expires_at)

    @property
    def options(self) -> BatchOptions:
        return BatchOptions.from_stored(self.stored_options)

    @options.setter
    def options(self, options: BatchOptions) -> None:
        self.stored_options = options.stored()

    @property
    def request(self) -> BatchRequest:
        """What its creator asked, as the row keeps it (its folder's batch.json holds the same)."""
        window = None if self.expires_at is None else Window(self.completion_window, self.expires_at - self.created_at)
        return BatchRequest(owner=self.owner, input_file_id=self.input_file_id, endpoint=self.endpoint,
                            model=self.model, window=window, metadata=self.meta,
                            output_expires_after=self.output_expires_after, options=self.options,
                            parent_batch_id=self.parent_batch_id)

    @request.setter
    def request(self, request: BatchRequest) -> None:
        """Keep `request` (its endpoint known), its deadline counted from created_at."""
        assert request.endpoint is not None, "the store fills the endpoint in from the input before"
        self.owner, self.input_file_id, self.endpoint, self.model = (request.owner, request.input_file_id or "",
                                                                     request.endpoint, request.model)
        self.completion_window = request.completion_window or NO_WINDOW
        self.expires_at = self.created_at + request.window.seconds if request.window is not None else None
        self.meta, self.output_expires_after = request.metadata, request.output_expires_after
        self.options, self.parent_batch_id = request.options, request.parent_batch_id

    def times(self) -> dict[str, Any]:
        """Its timestamps (TIMES), by name."""
        return {name: getattr(self, name) for name in TIMES}

    def counts(self) -> RequestCounts:
        """The batch's request_counts, from its `request_*` columns."""
        return RequestCounts(self.request_total, self.request_completed, self.request_failed,
                             self.request_incomplete_structured, self.request_invalid_structured)


class IntakeRecord(Base):
    """A dropped file (S3 object or inbox file) and the batch it became: one batch per source and version.

    `version` is the S3 ETag or the inbox file's size and mtime, so a changed file is a new batch
    and the same one never runs twice, whatever happens to the sensor's cursor.
    """

    __tablename__ = "intake"
    __table_args__ = (UniqueConstraint("source", "version", name="uq_intake_source_version"),)

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(MAX_SOURCE_CHARS))  # s3://bucket/key or file:///path
    version: Mapped[str] = mapped_column(String(MAX_VERSION_CHARS))
    batch_id: Mapped[str] = mapped_column(String(64), ForeignKey("batches.id"), unique=True)
    deliver_to: Mapped[str] = mapped_column(String(1024))  # where output, errors and summary are written
    created_at: Mapped[int]
    delivery_requested_at: Mapped[int | None]
    delivered_at: Mapped[int | None]


# A webhook event's type for each terminal status (OpenAI's names), in TERMINAL's order.
EVENT_TYPES: dict[str, str] = {status: f"batch.{status}" for status in TERMINAL}
# An extension's event, before the end: the queue estimates that the batch will end after its deadline.
DEADLINE_AT_RISK = "batch.deadline_at_risk"


class WebhookEvent(Base):
    """An event to send (OpenAI's shape): a batch reached a terminal status. Filled once, when the status is stored.

    `planned_at` is when the webhook sensor turned it into its deliveries: one per global endpoint configured
    then, one per endpoint of the batch's owner subscribed to its type then.
    """

    __tablename__ = "webhook_events"
    __table_args__ = (Index("ix_webhook_events_planned_at", "planned_at"),)

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)  # evt_...; the webhook-id of every attempt
    type: Mapped[str] = mapped_column(String(32))  # batch.completed, batch.failed, batch.expired, batch.cancelled
    batch_id: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int]
    planned_at: Mapped[int | None]


class WebhookEndpointRecord(Base):
    """An owner's webhook endpoint (OpenAI's webhook_endpoint object): where that owner's batch events go.

    `secret` is kept in clear because every delivery is signed with it; it is wiped when the endpoint is
    deleted. A deleted endpoint keeps its row (`deleted_at`) so that its past deliveries still name it.
    """

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_owner_pk", "owner", "pk"),)

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)  # we_...
    owner: Mapped[str] = mapped_column(String(64), ForeignKey("api_keys.owner"))
    name: Mapped[str] = mapped_column(String(255))
    url: Mapped[str] = mapped_column(String(1024))
    event_types: Mapped[list[str]] = mapped_column(JSON)
    secret: Mapped[str | None] = mapped_column(Text)  # whsec_...; None once deleted
    created_at: Mapped[int]
    deleted_at: Mapped[int | None]


class WebhookDelivery(Base):
    """One event to one endpoint: attempts so far and when the next is due; delivered or given up once.

    `endpoint_id` is None for a global endpoint (BATCH_WEBHOOK_URLS, signed with BATCH_WEBHOOK_SECRET), else
    the owner's endpoint whose secret signs it.
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (UniqueConstraint("event_id", "endpoint_id", "url", name="uq_webhook_delivery_event_endpoint_url"),
                      Index("ix_webhook_deliveries_due", "delivered_at", "failed_at", "next_attempt_at"))

    pk: Mapped[int] = mapped_column(PK, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(64), ForeignKey("webhook_events.id"))
    endpoint_id: Mapped[str | None] = mapped_column(String(64), ForeignKey("webhook_endpoints.id"))
    url: Mapped[str] = mapped_column(String(1024))
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[int]
    delivered_at: Mapped[int | None]
    failed_at: Mapped[int | None]  # given up after the last attempt
    last_error: Mapped[str | None] = mapped_column(Text)


class SensorTick(Base):
    """How one sensor's evaluations went, as the sensor itself counts them (defs/sensor_timing.py): the metrics'
    tick durations, read by the API, which loads no Dagster."""

    __tablename__ = "sensor_ticks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    ticks: Mapped[int] = mapped_column(default=0)
    failures: Mapped[int] = mapped_column(default=0)
    seconds_total: Mapped[float] = mapped_column(Float, default=0.0)
    last_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    last_at: Mapped[int]


class FleetRecord(Base):
    """A warm fleet `make serve` runs for a model (serve/fleets.py): where its router is, whether its replicas are
    up, how long they took to start last (which the ETA adds while they are not), and when an interactive call last
    wanted it."""

    __tablename__ = "fleets"

    model: Mapped[str] = mapped_column(String(MAX_MODEL_CHARS), primary_key=True)
    url: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))  # FLEET_STATES
    start_s: Mapped[float | None] = mapped_column(Float)
    changed_at: Mapped[int]
    # When the API last forwarded an interactive call to it (or was asked for one while it slept): serve keeps a fleet
    # in use warm, and wakes one that sleeps, as for a batch of its model.
    called_at: Mapped[int | None]


FLEET_STATES = ("starting", "warm", "asleep", "failed")
