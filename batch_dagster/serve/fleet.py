"""`batch-dagster fleet`: N vLLM OpenAI servers for one registry model behind vllm-router, started and stopped together.

Each replica runs the registry's settings (the same as the offline engine) and is pinned to its own
CPU core: vLLM's CPU backend binds its worker threads to cores, and two replicas on one core would
share it. The router (the vLLM project's vllm-router) balances requests, retries them on another
replica with backoff, and takes a replica out of rotation when its health checks fail.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from batch_dagster.serve.processes import Children, signal_group

log = logging.getLogger("batch_dagster.serve.fleet")


def free_port_block(n: int, host: str) -> int:
    """A port p such that p .. p+n-1 are free on `host` now: p is one the system picks, so that two fleets
    started at the same moment on one machine get different blocks."""
    import socket

    for _ in range(100):
        socks = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind((host, 0))
            base = first.getsockname()[1]
            for port in range(base + 1, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports on {host}")


def cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


@dataclass
class Fleet:
    """The replicas of one model on ports `port + 1 ...` and the router on `port` (0: a free block of ports)."""

    model: str
    replicas: int
    port: int
    command_for_port: Callable[[int], list[str]]  # a replica's server command on a port
    policy: str  # one of settings.POLICIES (BATCH_FLEET_POLICY is checked against them)
    host: str
    log_dir: Path = Path("data/logs/fleet")
    children: Children = field(default_factory=Children)
    _should_stop: Callable[[], bool] = field(default=lambda: False, repr=False)

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = free_port_block(self.replicas + 1, self.host)

    @property
    def url(self) -> str:
        """The router's base URL (without /v1)."""
        return f"http://{self.host}:{self.port}"

    @property
    def server_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.port + 1 + i}" for i in range(self.replicas)]

    def server_commands(self) -> list[tuple[list[str], dict[str, str]]]:
        """Each replica's command, pinned to a core of its own (round robin when replicas outnumber cores)."""
        available = cores()
        if self.replicas > len(available):
            log.warning("%d replicas on %d cores: some replicas share a core", self.replicas, len(available))
        out = []
        for i in range(self.replicas):
            core = available[i % len(available)]
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
            out.append((["taskset", "-c", str(core), *self.command_for_port(self.port + 1 + i)], env))
        return out

    def router_command(self) -> list[str]:
        router = Path(sys.executable).with_name("vllm-router")
        return [str(router), "--host", self.host, "--port", str(self.port), "--policy", self.policy,
                "--worker-urls", *self.server_urls,
                # A dead replica leaves the rotation after two failed checks, two seconds apart.
                "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                "--retry-max-retries", "5", "--request-timeout-secs", "1800",
                "--log-level", "warning"]

    def start(self, timeout_s: float = 600, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start the replicas, wait until each answers /health, then start the router and wait for it."""
        self._should_stop = should_stop
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i, (command, env) in enumerate(self.server_commands()):
            self.children.start(f"vllm-{i}", command, env, open(self.log_dir / f"vllm-{i}.log", "ab"))
        deadline = time.monotonic() + timeout_s
        for i, url in enumerate(self.server_urls):
            self._wait(url + "/health", deadline, f"vllm-{i}")
        self.children.start("router", self.router_command(), dict(os.environ),
                            open(self.log_dir / "router.log", "ab"))
        self._wait(self.url + "/v1/models", deadline, "router")

    def _wait(self, url: str, deadline: float, name: str) -> None:
        while time.monotonic() < deadline:
            if self._should_stop():
                raise KeyboardInterrupt
            if name in self.children.exited():
                raise RuntimeError(f"{name} exited before it was healthy; see {self.log_dir}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    log.info("%s is healthy (%s)", name, url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{name} did not answer {url} in time; see {self.log_dir}")

    def heal(self) -> None:
        """Restart the fleet's processes that died: a replica (the router sends its requests elsewhere meanwhile
        and takes it back once it answers its health checks) or the router (the runs' engine client resends
        what fails meanwhile, as for a router with no healthy replica)."""
        for name in self.children.exited():
            signal_group(self.children.procs[name].pid, signal.SIGKILL)  # what the dead process left behind
            log.warning("%s exited (code %s); restarting it", name, self.children.procs[name].returncode)
            if name == "router":
                command, env = self.router_command(), dict(os.environ)
            else:
                command, env = self.server_commands()[int(name.removeprefix("vllm-"))]
            self.children.start(name, command, env, open(self.log_dir / f"{name}.log", "ab"))

    def stop(self) -> None:
        self.children.stop()
