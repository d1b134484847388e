"""A nudge to the Dagster daemon's launch sensor that a batch was just created, so it ticks now rather than at its next
interval (up to 1.5 s later: issue #46's turnaround). `serve` gives the API and its daemon one Unix datagram socket
(in a folder only its user can enter); the daemon listens (defs/dagster_internals.py `nudged`). A nudge only hurries a
tick that comes anyway: one lost, or no socket (the API alone, Kubernetes), leaves the launch to the sensor's own
ticks."""

from __future__ import annotations

import contextlib
import socket


class LaunchNudge:
    def __init__(self, path: str | None) -> None:
        self.path = path

    def send(self) -> None:
        """Nudge the daemon, never blocking and never failing: call it once the batch's row is committed."""
        if not self.path:
            return
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(b"launch", self.path)
