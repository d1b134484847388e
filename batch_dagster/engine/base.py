"""What every engine does, and the failure handling shared by both modes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

Request = tuple[str, dict[str, Any]]  # (custom_id, body)
Line = dict[str, Any]


class EngineCrash(RuntimeError):
    """The engine itself failed (died, unreachable); the whole shard may be retried."""


class Engine(Protocol):
    def run(self, endpoint: str, requests: Sequence[Request]) -> list[Line]:
        """One output or error line per request, in any order."""
        ...


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()
