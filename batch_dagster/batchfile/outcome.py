"""A batch's outcome as people read it: what the CLI and the demo print and the delivered summary.json holds.

It is built from what is stored: a finished batch's summary.json (`BatchOutcome.of`), the validation of one that
failed (`BatchOutcome.failed`), or the batch's row (`db.batches.batch_outcome`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .contract import BatchError, RequestCounts
from .folder import Summary, Validation
from .status import BatchStatus
from .usage import Cost, Usage


@dataclass
class EngineRun:
    """Which engine ran the batch and how long this run spent starting it."""

    mode: str  # the record's engine_mode: "offline" (in this process) or "server"
    url: str | None  # the fleet, router or servers the requests went to (comma-separated); None offline
    start_s: float  # seconds spent starting the engine; 0 when it was running already

    @classmethod
    def of(cls, record: dict[str, Any]) -> EngineRun:
        """From a summary's `record` (model_record plus the engine_start_s the shards paid)."""
        return cls(mode=str(record.get("engine_mode", "")), url=record.get("engine_url"),
                   start_s=float(record.get("engine_start_s", 0.0)))

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "url": self.url, "start_s": self.start_s}

    def describe(self) -> str:
        """One line for a person, e.g. "offline vLLM in this process, started in 27.3 s"."""
        if self.url is not None:
            return f"the vLLM server(s) at {self.url} (no engine start)"
        engine = "offline vLLM" if self.mode == "offline" else f"the {self.mode} engine"
        if not self.start_s:
            return f"{engine} in this process, already running (no engine start)"
        return f"{engine} in this process, started in {self.start_s:.1f} s"


@dataclass
class BatchOutcome:
    """A batch's end as the CLI and the demo show it; `to_dict` is its JSON (the CLI's --json keys)."""

    batch_id: str
    status: str  # a BatchStatus value
    endpoint: str | None
    model: str | None
    request_counts: RequestCounts
    usage: Usage | None = None
    cost: Cost | None = None
    errors: list[BatchError] | None = None  # None: none recorded
    # How it ran: only for a batch that finished (None otherwise).
    inference_s: float | None = None
    output_tokens_per_s: float | None = None
    engine: EngineRun | None = None
    times: dict[str, int] = field(default_factory=dict)  # the status timestamps the record holds (e.g. completed_at)

    @classmethod
    def of(cls, summary: Summary) -> BatchOutcome:
        return cls(batch_id=summary.batch_id, status=summary.status, endpoint=summary.endpoint, model=summary.model,
                   request_counts=summary.request_counts, usage=summary.usage, cost=summary.cost,
                   errors=summary.errors or None, inference_s=summary.inference_s,
                   output_tokens_per_s=summary.output_tokens_per_s, engine=EngineRun.of(summary.record))

    @classmethod
    def failed(cls, batch_id: str, validation: Validation | None, errors: list[BatchError]) -> BatchOutcome:
        """A batch that did not finish: what its validation found, and why it failed."""
        return cls(batch_id=batch_id, status=BatchStatus.FAILED,
                   endpoint=validation.endpoint if validation else None,
                   model=validation.model if validation else None,
                   request_counts=RequestCounts(total=validation.total_requests if validation else 0),
                   errors=errors)

    def shown(self) -> dict[str, Any]:
        """The part every view of the batch shows alike (the CLI's --json, the delivered summary.json)."""
        return {
            "status": self.status, "endpoint": self.endpoint, "model": self.model,
            "request_counts": self.request_counts.to_dict(),
            "usage": self.usage.to_dict() if self.usage else None,
            "cost": self.cost.to_dict() if self.cost else None,
        }

    def errors_shown(self) -> list[dict[str, Any]] | None:
        return None if self.errors is None else [e.to_dict() for e in self.errors]

    def to_dict(self) -> dict[str, Any]:
        """The CLI's --json: the run's facts for a batch that ended, its errors for one that failed."""
        data: dict[str, Any] = {"batch_id": self.batch_id, **self.shown()}
        if self.status == BatchStatus.FAILED:
            data["errors"] = self.errors_shown() or []
        else:
            data |= {"inference_s": self.inference_s, "output_tokens_per_s": self.output_tokens_per_s,
                     "engine": self.engine.to_dict() if self.engine else None}
        return data


@dataclass
class RunOutcome:
    """What `run_batch` returns: the batch's outcome and the facts of the run that made it."""

    batch: BatchOutcome
    run_id: str
    output_file: str
    error_file: str
    duration_s: float
    log_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.batch.to_dict() | {
            "run_id": self.run_id,
            **({"log_file": self.log_file} if self.log_file is not None else {}),
            "output_file": self.output_file,
            "error_file": self.error_file,
            "duration_s": self.duration_s,
        }
