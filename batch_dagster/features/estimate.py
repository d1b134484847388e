"""A batch's estimate before it runs: validation's report, its tokens, the range of its cost and of its duration.

Tokens are counted as the engine counts them (engine/tokens.py: vLLM's renderer, in a count worker or on the model's
servers), the durations divide them by the model's engine throughput (throughput.py) after the work queued ahead.
The API (`count_file`, then `price_file`) and the CLI (`estimate_file`) estimate a file; a valid batch's validation
writes its own (`write_estimate`). docs/http-api.md ("Estimate") says what each bound assumes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from batch_dagster.batchfile import anthropic, responses
from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.bodies import BodyError, check_body
from batch_dagster.batchfile.columnar import read_requests
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.registry import served
from batch_dagster.batchfile.status import TERMINAL
from batch_dagster.batchfile.storage import Storage
from batch_dagster.batchfile.usage import PriceTable, Usage, cost_of, load_price_table
from batch_dagster.batchfile.validate import ValidationReport, validate_stream
from batch_dagster.batchfile.windows import Window
from batch_dagster.db.models import BatchRecord
from batch_dagster.engine.models import Models, server_urls_for
from batch_dagster.engine.tokens import CountTimeout, CountTokens
from batch_dagster.settings import Settings

from .throughput import Throughput, engine_throughput, queue_throughput


@dataclass(frozen=True)
class QueueAhead:
    """Batches of the same model queued or in progress, and their requests not yet finished."""

    batches: int = 0
    requests: int = 0  # of the batches validation has counted
    uncounted: int = 0  # batches not validated yet: each is taken as the size of the one estimated


def max_output_tokens(endpoint: str, body: dict[str, Any], prompts: list[int], context_length: int) -> int | None:
    """The most output tokens a request can produce; None when the engine refuses it (as vLLM's server does:
    a bad `max_tokens` or one past the context, a prompt that fills it). A `max_tokens` past what the prompt leaves
    of the context is cut to it, as vLLM's server cuts it."""
    if endpoint in (c.EMBEDDINGS, c.SCORE, c.RERANK):  # no output tokens
        return 0 if endpoint != c.EMBEDDINGS or all(p <= context_length for p in prompts) else None
    if endpoint == c.RESPONSES:
        body = responses.chat_body(body)
    elif endpoint == c.MESSAGES:
        body = anthropic.chat_body(body)
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
        return None
    longest = max(prompts, default=0)
    if longest >= context_length or (requested or 0) > context_length:
        return None
    if requested is None:
        generating = endpoint in (c.CHAT, c.RESPONSES, c.MESSAGES)
        requested = context_length - longest if generating else c.COMPLETIONS_MAX_TOKENS
    requested = min(requested, context_length - longest)
    n = body.get("n", 1)
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    if choices > 1 and body.get("temperature") == 0:  # vLLM: "n must be 1 when using greedy sampling"
        return None
    return requested * choices * len(prompts)


def _refused_by_schema(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether validation rejected the body (it ends as its own 400 line and never runs)."""
    try:
        check_body(endpoint, body)
    except BodyError:
        return True
    return False


@dataclass
class Tally:
    """The requests that will run, their prompt tokens and their bound on output tokens."""

    requests: int = 0
    refused: int = 0  # valid lines that end as error lines without running (rejected bodies, past the context)
    input_tokens: int = 0
    max_output_tokens: int = 0

    def add(self, endpoint: str, body: dict[str, Any], count: CountTokens, context_length: int) -> None:
        prompts = None if _refused_by_schema(endpoint, body) else count(endpoint, body)
        bound = None if prompts is None else max_output_tokens(endpoint, body, prompts, context_length)
        if prompts is None or bound is None:
            self.refused += 1
            return
        self.requests += 1
        self.input_tokens += sum(prompts)
        self.max_output_tokens += bound

    def cost(self, model: str, prices: PriceTable, window: str | None = None) -> dict[str, Any]:
        """The cost range of these requests in a batch of `window` (Estimate.cost; the cost cap checks its max)."""
        low = cost_of(Usage(input_tokens=self.input_tokens), model, prices, window)
        high = cost_of(Usage(input_tokens=self.input_tokens, output_tokens=self.max_output_tokens), model, prices,
                       window)
        return {"min": low.total_cost, "max": high.total_cost, "currency": high.currency}


@dataclass
class Estimate:
    """The answer of POST /v1/batches/estimate and `batch-dagster estimate` (`to_dict`)."""

    report: ValidationReport
    tally: Tally = field(default_factory=Tally)
    prices: PriceTable = field(default_factory=PriceTable)
    throughput: Throughput | None = None
    queue: QueueAhead = field(default_factory=QueueAhead)
    window: str | None = None  # the completion window, which prices the batch (None: the model's batch price)
    deadline_s: float | None = None  # the seconds the batch has before its deadline (None: it has none)

    def cost(self) -> dict[str, Any] | None:
        """min: every request that runs succeeds with no output (failed requests are not billed, so failures
        only lower it); max: every one succeeds with its most output."""
        model = self.report.model
        return None if model is None else self.tally.cost(model, self.prices, self.window)

    def meets_deadline(self) -> bool | None:
        """Whether the batch ends before its deadline even at duration_s.max (after the work queued ahead, each
        request at its most output); None without a deadline or a duration."""
        duration = self.duration_s()
        return None if duration is None or self.deadline_s is None else duration["max"] <= self.deadline_s

    def deadline_refusal(self) -> str | None:
        """Why the batch cannot end before its deadline (duration_s.min, its prompt tokens alone on an idle engine,
        is past it), or None."""
        duration = self.duration_s()
        if duration is None or self.deadline_s is None or duration["min"] <= self.deadline_s:
            return None
        return (f"completion_window {self.window!r} leaves {self.deadline_s:.0f} s; this batch needs at least "
                f"{duration['min']:.0f} s (its {self.tally.input_tokens} prompt tokens alone, at "
                f"{self.throughput.tokens_per_s if self.throughput else 0:g} tokens/s on an idle engine). Use a longer "
                "completion_window, or split the file.")

    def duration_s(self) -> dict[str, float] | None:
        """min: this batch's prompt tokens alone, on an idle engine; max: its prompt and most output tokens, after
        the requests queued ahead, each counted as this batch's mean request at its most output (and a batch not
        validated yet as this whole batch)."""
        if self.throughput is None or self.throughput.tokens_per_s <= 0:
            return None
        t, q = self.tally, self.queue
        most = t.input_tokens + t.max_output_tokens
        ahead = (most / t.requests * q.requests if t.requests else 0.0) + most * q.uncounted
        rate = self.throughput.tokens_per_s
        return {"min": round(t.input_tokens / rate, 1), "max": round((most + ahead) / rate, 1)}

    def to_dict(self) -> dict[str, Any]:
        r, valid = self.report, self.report.valid
        return {
            "object": "batch.estimate",
            "valid": valid,
            "errors": {"object": "list", "data": [e.to_dict() for e in r.listed_errors]},
            "model": r.shown_model,
            "endpoint": r.endpoint,
            "total_requests": r.total_requests,
            "refused_requests": self.tally.refused if valid else None,
            "input_tokens": self.tally.input_tokens if valid else None,
            "max_output_tokens": self.tally.max_output_tokens if valid else None,
            "cost": self.cost() if valid else None,
            "duration_s": self.duration_s() if valid else None,
            "tokens_per_s": self.throughput.tokens_per_s if valid and self.throughput else None,
            "throughput_batches": self.throughput.batches if valid and self.throughput else None,
            "queued_ahead": self.queue.batches,
            "queued_ahead_requests": self.queue.requests,
            "queued_ahead_uncounted": self.queue.uncounted,
            "meets_deadline": self.meets_deadline() if valid else None,
        }


@dataclass(frozen=True)
class Counted:
    """A file's validation report and its tokens: what an estimate computes from the file's bytes alone (so one
    File's count serves each estimate of it)."""

    report: ValidationReport
    tally: Tally


def count_stream(
    f: BinaryIO,
    *,
    size: int | None,
    limits: c.Limits,
    endpoint: str | None,
    served: Collection[str],
    counter: Callable[[str], tuple[CountTokens, int]],
) -> Counted:
    """Validate the file and count its tokens in one pass.

    `counter(model)` is the model's CountTokens and context length; it is asked for once, for a model the
    registry (`served`) serves, so an unknown model costs no tokenizer. CountTimeout names the line it stopped at.
    """
    tally = Tally()
    counters: dict[str, tuple[CountTokens, int] | None] = {}  # only the file's first model gets one

    def on_request(line: int, request: dict[str, Any]) -> None:
        model = request["body"]["model"]
        if model not in counters:
            counters[model] = counter(model) if model in served and not counters else None
        found = counters[model]
        if found is not None:
            try:
                tally.add(request["url"], request["body"], *found)
            except CountTimeout as exc:
                raise exc.at(line) from None

    report = validate_stream(f, size=size, limits=limits, endpoint=endpoint, models=served, on_request=on_request)
    return Counted(report, tally)


def priced(counted: Counted, prices: PriceTable, throughput: Callable[[str], Throughput],
           queue: Callable[[str], QueueAhead], window: Window | None = None) -> Estimate:
    """A counted file priced for its `window`, and timed on the model's throughput after the queue ahead of it (as
    they are now)."""
    estimate = Estimate(counted.report, counted.tally, prices, window=window.name if window else None,
                        deadline_s=window.seconds if window else None)
    if counted.report.valid and counted.report.model is not None:
        model = counted.report.model
        estimate.throughput, estimate.queue = throughput(model), queue(model)
    return estimate


def queue_ahead(session: Session, model: str, exclude: str | None = None) -> QueueAhead:
    """Every owner's batches of `model` that have not ended (one engine serves them all), their requests not
    finished yet, and how many of them validation has not counted yet; without the batch `exclude` (the one
    validation estimates)."""
    left = BatchRecord.request_total - BatchRecord.request_completed - BatchRecord.request_failed
    uncounted = case((BatchRecord.request_total == 0, 1), else_=0)  # validation counts a batch's requests
    batches, requests, not_counted = session.execute(
        select(func.count(), func.coalesce(func.sum(left), 0), func.coalesce(func.sum(uncounted), 0))
        .where(BatchRecord.model == model, BatchRecord.status.not_in(TERMINAL),
               BatchRecord.id != (exclude or ""))).one()
    return QueueAhead(int(batches), int(requests), int(not_counted))


def count_file(f: BinaryIO, *, size: int | None, endpoint: str | None, models: Models,
               settings: Settings) -> Counted:
    """A file validated and counted as the engine counts it: the slow part of an estimate, and its file's alone.
    Counting stops at BATCH_ESTIMATE_TIMEOUT_S (CountTimeout, with the line it reached)."""

    def counter(model: str) -> tuple[CountTokens, int]:
        servers = server_urls_for(model, settings.fleet_urls, settings.engine_mode, list(settings.vllm_server_urls))
        return models.counter(model, servers=servers, api_key=settings.vllm_api_key,
                              budget_s=settings.estimate_timeout_s)

    return count_stream(f, size=size, limits=settings.limits, endpoint=endpoint,
                        served=served(models.registry(), settings.image_sources), counter=counter)


def price_file(counted: Counted, *, session: Session, storage: Storage, settings: Settings,
               window: Window | None = None) -> Estimate:
    """A counted file priced for its `window`, and timed on the model's engine throughput and the queue ahead of
    it."""
    return priced(counted, load_price_table(settings.prices_file),
                  throughput=lambda model: engine_throughput(session, storage, model, settings.estimate_tokens_per_s),
                  queue=lambda model: queue_ahead(session, model), window=window)


def estimate_file(f: BinaryIO, *, size: int | None, endpoint: str | None, session: Session, storage: Storage,
                  models: Models, settings: Settings, window: Window | None = None) -> Estimate:
    """`batch-dagster estimate`'s answer for a file (the API's, in two steps): validated and counted with the
    model's tokenizer, priced for its `window`, timed on the model's engine throughput and the queue ahead of it."""
    return price_file(count_file(f, size=size, endpoint=endpoint, models=models, settings=settings),
                      session=session, storage=storage, settings=settings, window=window)


def unreachable_deadline(session: Session, model: str | None, input_bytes: int, window: Window) -> str | None:
    """At create, before anything is tokenized: why `window` is too short for a batch of `input_bytes` of `model`,
    or None. By the ETA's measure (throughput.queue_throughput: the bounded tokens per input byte and per second of
    the model's recent batches), the batch alone, with nothing queued ahead, takes longer than the window. Nothing
    is refused before the model has a measured batch: a default rate is no evidence."""
    rate = queue_throughput(session, model, 0.0)
    if rate.batches == 0 or rate.tokens_per_s <= 0:
        return None
    alone_s = input_bytes * rate.tokens_per_byte / rate.tokens_per_s
    if alone_s <= window.seconds:
        return None
    return (f"completion_window {window.name!r} leaves {window.seconds} s; a batch of this file's size "
            f"({input_bytes} bytes) takes about {alone_s:.0f} s by itself at the pace of {model}'s last "
            f"{rate.batches} batch(es). Use a longer completion_window, or split the file.")


def count_tokens(requests: Path, report: ValidationReport, models: Models, *, needed: bool, log: Any,
                 servers: list[str] | None = None, api_key: str | None = None) -> Tally | None:
    """Validation's one count of a valid batch's tokens, which the token limit, the cost cap and the estimate read:
    its validated `requests` counted once as the engine counts them (by the model's `servers` when it has some; each
    request's prompt and bound on output, as an estimate counts them).

    A request whose count outlasts its bound (its chat template renders too long) makes the batch invalid, at that
    line (`count_timeout`): nothing of it is counted further, nothing runs. None for an invalid batch, or when the
    count fails and nothing `needed` it (a limit that must hold fails the step instead); that failure is logged and
    the batch runs without an estimate.
    """
    if not report.valid or report.model is None or report.endpoint is None:
        return None
    try:
        count, context_length = models.counter(report.model, servers=servers, api_key=api_key)
        tally = Tally()
        for line, body in read_requests(requests):
            try:
                tally.add(report.endpoint, body, count, context_length)
            except CountTimeout as exc:
                report.errors.append(c.BatchError(c.COUNT_TIMEOUT, exc.reason, line))
                report.error_count += 1
                return None
    except Exception as exc:
        if needed:
            raise
        log.warning(f"The batch's tokens could not be counted, so it has no estimate: {str(exc)[:500]}")
        return None
    return tally


def write_estimate(session: Session | None, folder: BatchFolder, report: ValidationReport, tally: Tally,
                   prices: PriceTable, default_tokens_per_s: float) -> dict[str, Any]:
    """A valid batch's estimate, made once by validation: what the estimate endpoint answers for its file (validation's
    `report` and `tally`, the model's engine throughput, the queue without the batch itself), written to its folder
    (estimate.json; the status sensor copies it onto the batch's row). A re-run keeps the one made first. Without a
    store (`session` None: a table batch's), the default rate and no queue."""
    if (made := folder.estimate()) is not None:
        return made
    model = report.model
    assert model is not None  # a valid report names its model
    if session is None:
        throughput, queue = Throughput(default_tokens_per_s), QueueAhead()
    else:
        throughput = engine_throughput(session, folder.storage, model, default_tokens_per_s)
        queue = queue_ahead(session, model, exclude=folder.batch_id)
    deadline = folder.deadline()
    estimate = Estimate(report, tally, prices, throughput, queue, window=folder.completion_window(),
                        deadline_s=deadline.expires_at - time.time() if deadline else None).to_dict()
    folder.write_estimate(estimate)
    return estimate
