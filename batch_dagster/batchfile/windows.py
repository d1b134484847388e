"""Completion windows: the `completion_window` values a batch may ask ("1h", "24h", ...), which of them the operator
offers, and how long each one really is: its batch expires (its deadline) that many seconds after it was created."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

HOUR_S = 3600
NO_WINDOW = "24h"  # what a batch with no window (no deadline: the command line's) shows, as OpenAI's only window
MAX_WINDOW_HOURS = 720  # 30 days, as OpenAI's longest file and output expiry
_WINDOW = re.compile(r"([1-9][0-9]{0,2})h")


def window_hours(window: str) -> int | None:
    """The hours a window's name says ("24h": 24), or None when it is not a window: a whole number of hours, 1 to
    MAX_WINDOW_HOURS, then `h`."""
    match = _WINDOW.fullmatch(window)
    hours = int(match.group(1)) if match else 0
    return hours if 1 <= hours <= MAX_WINDOW_HOURS else None


@dataclass(frozen=True)
class Window:
    """One window a batch was created with: its name and its real length (seconds to its deadline)."""

    name: str
    seconds: int


@dataclass(frozen=True)
class CompletionWindows:
    """The windows the operator offers (BATCH_COMPLETION_WINDOWS), each with its real length in seconds."""

    lengths: Mapping[str, int]

    @classmethod
    def of(cls, entries: Iterable[str]) -> CompletionWindows:
        """From BATCH_COMPLETION_WINDOWS' entries: `24h`, a window as long as its name says; `24h=1440`, as long as
        given (a test's, a bench's short windows). ValueError names the entry that is not a window."""
        lengths: dict[str, int] = {}
        for entry in (part.strip() for part in entries):
            if not entry:
                continue
            name, equals, seconds = (part.strip() for part in entry.partition("="))
            hours = window_hours(name)
            if hours is None:
                raise ValueError(f"{entry!r} is not a window: a whole number of hours (1 to {MAX_WINDOW_HOURS}) and "
                                 "'h', as 1h or 24h, optionally '=SECONDS' for its real length")
            if equals and not (seconds.isdigit() and int(seconds) > 0):
                raise ValueError(f"{entry!r}: the length after '=' must be a whole number of seconds, 1 or more")
            if name in lengths:
                raise ValueError(f"{name!r} is listed twice")
            lengths[name] = int(seconds) if equals else hours * HOUR_S
        if not lengths:
            raise ValueError("no window: list at least one, as 24h")
        return cls(lengths)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.lengths)

    def window(self, name: str) -> Window:
        """An offered window (KeyError: not offered; `refusal` says why first)."""
        return Window(name, self.lengths[name])

    @property
    def default(self) -> Window:
        """The window of a batch that names none (a dropped file): the longest offered, the most patient."""
        return self.window(max(self.lengths, key=lambda name: (self.lengths[name], name)))

    def refusal(self, name: str) -> tuple[str, str] | None:
        """Why a create body's `completion_window` is refused, as (code, message); None when it is offered."""
        if name in self.lengths:
            return None
        offered = ", ".join(repr(n) for n in self.lengths)
        if window_hours(name) is None:
            return "invalid_completion_window", (
                f"completion_window {name[:64]!r} is not a window: a whole number of hours and 'h' (as '24h'); "
                f"this service offers {offered}.")
        return "completion_window_not_offered", (
            f"completion_window {name!r} is not offered here; use one of {offered} (BATCH_COMPLETION_WINDOWS).")
