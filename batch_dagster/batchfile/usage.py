"""Token usage and cost: totals over output lines, priced from a price table."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .registry import dotted_hint


@dataclass
class Usage:
    """A batch's usage, named as in the Batch object's `usage`."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def add_body(self, body: dict[str, Any]) -> None:
        """Add the `usage` of one response body (chat, completion, embedding, a `response`, Anthropic's `message`)."""
        u = body.get("usage") or {}
        if body.get("object") == "response":  # the Responses API names its counts like the Batch object
            self.input_tokens += int(u.get("input_tokens") or 0)
            self.output_tokens += int(u.get("output_tokens") or 0)
            self.cached_tokens += int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
            self.reasoning_tokens += int((u.get("output_tokens_details") or {}).get("reasoning_tokens") or 0)
            return
        if body.get("type") == "message":  # Anthropic's input_tokens leave out those read from or written to cache
            cached = int(u.get("cache_read_input_tokens") or 0)
            written = int(u.get("cache_creation_input_tokens") or 0)
            self.input_tokens += int(u.get("input_tokens") or 0) + cached + written
            self.output_tokens += int(u.get("output_tokens") or 0)
            self.cached_tokens += cached
            return
        self.input_tokens += int(u.get("prompt_tokens") or 0)
        self.output_tokens += int(u.get("completion_tokens") or 0)
        self.cached_tokens += int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.reasoning_tokens += int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)

    def __iadd__(self, other: Usage) -> Usage:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens
        self.reasoning_tokens += other.reasoning_tokens
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.total_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Usage:
        return cls(
            input_tokens=d.get("input_tokens", 0),
            output_tokens=d.get("output_tokens", 0),
            cached_tokens=(d.get("input_tokens_details") or {}).get("cached_tokens", 0),
            reasoning_tokens=(d.get("output_tokens_details") or {}).get("reasoning_tokens", 0),
        )


@dataclass(frozen=True)
class Price:
    """Real-time prices per 1M tokens for one model, and the discount batches get (on every rate).

    `cached_input_per_1m`: input tokens the engine's prefix cache served (usage's `cached_tokens`); None: the input
    rate.
    """

    input_per_1m: float = 0.0
    output_per_1m: float = 0.0
    batch_discount: float = 0.5
    currency: str = "USD"
    cached_input_per_1m: float | None = None

    @property
    def cached_rate(self) -> float:
        return self.input_per_1m if self.cached_input_per_1m is None else self.cached_input_per_1m


@dataclass(frozen=True)
class PriceTable:
    """Prices by model name; models without an entry use `default`. A completion window's entry (`windows`, and a
    model's own for that window, `model_windows`) changes the fields it names for the batches of that window."""

    prices: dict[str, Price] = field(default_factory=dict)
    default: Price = Price()
    windows: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_windows: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def for_model(self, model: str, window: str | None = None) -> Price:
        """The price of `model`'s batches of `window` (None: a batch with no window: the model's price)."""
        price = self.prices.get(model, self.default)
        if window is None:
            return price
        return replace(price, **{**self.windows.get(window, {}), **self.model_windows.get((model, window), {})})

    def unlisted(self, model: str) -> str | None:
        """What to tell the user when `model` has no entry (it is priced by the defaults), or None."""
        if model in self.prices:
            return None
        d = self.default
        return (f"model {model!r} is not in the price table: priced at its [defaults] ({d.input_per_1m} input, "
                f"{d.output_per_1m} output {d.currency} per 1M tokens)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PriceTable:
        """Build from a parsed price file: `[defaults]`, `[models.NAME]`, `[windows.WINDOW]` and
        `[models.NAME.windows.WINDOW]` tables. A key that is not a price's field is refused (ValueError)."""
        base = _entry(d.get("defaults", {}), "[defaults]")
        models, model_windows = {}, {}
        for name, entry in d.get("models", {}).items():
            own = dict(entry)
            for window, change in own.pop("windows", {}).items():
                model_windows[(name, window)] = _entry(change, f"[models.{name}.windows.{window}]")
            try:
                models[name] = Price(**{**base, **_entry(own, f"[models.{name}]")})
            except ValueError as exc:
                raise ValueError(f"{exc}.{dotted_hint(name, own)}") from None
        windows = {window: _entry(change, f"[windows.{window}]") for window, change in d.get("windows", {}).items()}
        return cls(models, Price(**base), windows, model_windows)


_PRICE_FIELDS = {f.name for f in fields(Price)}


def _entry(entry: dict[str, Any], where: str) -> dict[str, Any]:
    if unknown := set(entry) - _PRICE_FIELDS:
        raise ValueError(f"the price table's {where} has {', '.join(sorted(unknown))}: not a price's field "
                         f"({', '.join(sorted(_PRICE_FIELDS))})")
    return dict(entry)


def load_price_table(path: Path) -> PriceTable:
    with open(path, "rb") as f:
        return PriceTable.from_dict(tomllib.load(f))


@dataclass(frozen=True)
class Cost:
    """What a batch costs: only successful requests' tokens, at the discounted batch price. `input_cost` is that of
    all input tokens, `cached_input_cost` the part of it the prefix cache's tokens cost (at their own rate)."""

    model: str
    input_cost: float
    output_cost: float
    batch_discount: float
    currency: str
    cached_input_cost: float = 0.0

    @property
    def total_cost(self) -> float:
        return round(self.input_cost + self.output_cost, 8)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_cost": self.total_cost}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cost:
        """Read back from `to_dict` (total_cost is derived, so it is not read)."""
        return cls(model=d.get("model", ""), input_cost=d.get("input_cost", 0.0),
                   output_cost=d.get("output_cost", 0.0), batch_discount=d.get("batch_discount", 0.0),
                   currency=d.get("currency", "USD"), cached_input_cost=d.get("cached_input_cost", 0.0))


def cost_of(usage: Usage, model: str, prices: PriceTable, window: str | None = None) -> Cost:
    """Price `usage` (which must count successful requests only) for `model`'s batches of `window`."""
    p = prices.for_model(model, window)
    factor = 1.0 - p.batch_discount
    cached = min(usage.cached_tokens, usage.input_tokens)
    cached_cost = cached * p.cached_rate / 1e6 * factor
    return Cost(
        model=model,
        input_cost=round((usage.input_tokens - cached) * p.input_per_1m / 1e6 * factor + cached_cost, 8),
        output_cost=round(usage.output_tokens * p.output_per_1m / 1e6 * factor, 8),
        batch_discount=p.batch_discount,
        currency=p.currency,
        cached_input_cost=round(cached_cost, 8),
    )
