"""A batch's estimate before it runs: validation's report, its tokens, the range of its cost and of its duration.

The arithmetic only: tokens are counted by a `CountTokens` the caller builds from the model's tokenizer
(engine/tokens.py), the throughput and the queue come from the store (db/estimate.py). Nothing runs, nothing is
created. docs/http-api.md ("Estimate") says what each bound assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from . import contract as c
from . import responses
from .bodies import BodyError, check_body
from .usage import PriceTable, Usage, cost_of
from .validate import ValidationReport, validate_stream

# A request's prompt tokens as the engine counts them, one count per prompt (a completions or embeddings body
# may hold several); None when the engine will refuse the request before it runs (its template fails on it).
CountTokens = Callable[[str, dict[str, Any]], list[int] | None]
# As vLLM's server: a legacy completion without max_tokens generates at most 16 tokens.
COMPLETIONS_MAX_TOKENS = 16


@dataclass(frozen=True)
class Throughput:
    """Tokens (prompt and output) the model's engine works through per second of inference."""

    tokens_per_s: float
    batches: int = 0  # the recent batches it was measured on; 0: the BATCH_ESTIMATE_TOKENS_PER_S default


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
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
        return None
    longest = max(prompts, default=0)
    if longest >= context_length or (requested or 0) > context_length:
        return None
    if requested is None:
        requested = context_length - longest if endpoint in (c.CHAT, c.RESPONSES) else COMPLETIONS_MAX_TOKENS
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

    def cost(self, model: str, prices: PriceTable) -> dict[str, Any]:
        """The cost range of these requests (Estimate.cost; the cost cap checks its max)."""
        low = cost_of(Usage(input_tokens=self.input_tokens), model, prices)
        high = cost_of(Usage(input_tokens=self.input_tokens, output_tokens=self.max_output_tokens), model, prices)
        return {"min": low.total_cost, "max": high.total_cost, "currency": high.currency}


@dataclass
class Estimate:
    """The answer of POST /v1/batches/estimate and `batch-dagster estimate` (`to_dict`)."""

    report: ValidationReport
    tally: Tally = field(default_factory=Tally)
    prices: PriceTable = field(default_factory=PriceTable)
    throughput: Throughput | None = None
    queue: QueueAhead = field(default_factory=QueueAhead)

    def cost(self) -> dict[str, Any] | None:
        """min: every request that runs succeeds with no output (failed requests are not billed, so failures
        only lower it); max: every one succeeds with its most output."""
        model = self.report.model
        return None if model is None else self.tally.cost(model, self.prices)

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
        }


def estimate_stream(
    f: BinaryIO,
    *,
    size: int | None,
    limits: c.Limits,
    endpoint: str | None,
    served: Collection[str],
    counter: Callable[[str], tuple[CountTokens, int]],
    prices: PriceTable,
    throughput: Callable[[str], Throughput],
    queue: Callable[[str], QueueAhead],
) -> Estimate:
    """Validate the file and count its tokens in one pass; then price it and time it.

    `counter(model)` is the model's CountTokens and context length; it is asked for once, for a model the
    registry (`served`) serves, so an unknown model costs no tokenizer.
    """
    tally = Tally()
    counters: dict[str, tuple[CountTokens, int] | None] = {}  # only the file's first model gets one

    def on_request(_line: int, request: dict[str, Any]) -> None:
        model = request["body"]["model"]
        if model not in counters:
            counters[model] = counter(model) if model in served and not counters else None
        found = counters[model]
        if found is not None:
            tally.add(request["url"], request["body"], *found)

    report = validate_stream(f, size=size, limits=limits, endpoint=endpoint, models=served, on_request=on_request)
    estimate = Estimate(report, tally, prices)
    if report.valid and report.model is not None:
        estimate.throughput, estimate.queue = throughput(report.model), queue(report.model)
    return estimate
