"""What every engine does, and the failure handling shared by both modes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

Request = tuple[str, dict[str, Any]]  # (custom_id, body)
Line = dict[str, Any]
OnProgress = Callable[[int], None]  # called with the number of requests just finished


class EngineCrash(RuntimeError):
    """The engine itself failed (died, unreachable); the whole shard may be retried."""


class Engine(Protocol):
    def run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None = None) -> list[Line]:
        """One output or error line per request, in any order."""
        ...


class ProgressTicker:
    """Stands in for the tqdm bar vLLM's `use_tqdm` builds, forwarding finished requests to a callback."""

    def __init__(self, on_progress: OnProgress):
        self.on_progress = on_progress
        self.n = 0
        self.total: int | None = None
        self.postfix = ""
        self._started = time.monotonic()

    def __call__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        # vLLM also wraps the prompts it adds in a bar; those pass through uncounted.
        if iterable is None:
            self.total = kwargs.get("total", self.total)
            return self
        return iterable

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.monotonic() - self._started, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        # vLLM sets the postfix (its token rates) just before each update: pass it on as the engine's load.
        report_load = getattr(self.on_progress, "report_load", None)
        if report_load is not None:
            unfinished = f"{self.total - self.n} unfinished, " if self.total is not None else ""
            report_load(f"{unfinished}{self.postfix}".strip(", "))
        self.on_progress(n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()
