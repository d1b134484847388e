"""`batch-dagster fleet`: N vLLM OpenAI servers for one registry model behind vllm-router, started and stopped together.

Each replica runs the registry's settings (the same as the offline engine). On a GPU host each gets GPUs of its own
(as many as the model's tensor parallelism takes); on a CPU, a core of its own, since vLLM's CPU backend binds its
worker threads to cores. The router (the vLLM project's vllm-router) balances requests, retries them on another
replica with backoff, and takes a replica out of rotation when its health checks fail. A fleet owns a block of
ports: the router's, one per replica, and the router's Prometheus exporter's, so several fleets share a machine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from batch_dagster.serve.processes import Children, signal_group

log = logging.getLogger("batch_dagster.serve.fleet")


def free_port_block(n: int, host: str) -> int:
    """A port p such that p .. p+n-1 are free on `host` now, for servers that bind them seconds later: outside the
    range the system hands outgoing connections their ports from (one of those could take a port meanwhile), and p at
    random, so that two fleets started at the same moment get different blocks."""
    import random
    import socket

    low, high = ephemeral_ports()
    outside = [r for r in (range(10_000, low - n), range(high + 1, 65_536 - n)) if len(r) >= 1_000]
    pick = random.SystemRandom()
    for _ in range(200):
        if outside:
            base = pick.choice(pick.choice(outside))
        else:  # a system whose outgoing connections may take any port: one it picks
            with socket.socket() as s:
                s.bind((host, 0))
                base = s.getsockname()[1]
        if not taken_ports(host, range(base, base + n), reuse=False):
            return base
    raise RuntimeError(f"no block of {n} free ports on {host}")


def ephemeral_ports() -> tuple[int, int]:
    """The first and last port the system gives outgoing connections (Linux's net.ipv4.ip_local_port_range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def taken_ports(host: str, ports: Iterable[int], reuse: bool = True) -> list[int]:
    """Those of `ports` a server could not bind on `host` now. `reuse`: as vLLM and the router bind (address reuse
    on: a port a closed connection left in TIME_WAIT is free; one that listens, or a live connection's end, is not);
    otherwise a port in TIME_WAIT is taken too."""
    import socket

    taken = []
    for port in ports:
        with socket.socket() as s:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


def cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Placement:
    """Where one replica runs: the GPUs it is given, or else the CPU core it is pinned to."""

    core: int = 0
    gpus: tuple[str, ...] = ()

    def command(self, command: list[str]) -> list[str]:
        return command if self.gpus else ["taskset", "-c", str(self.core), *command]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        if self.gpus:  # vLLM (and torch) number the GPUs it may see from 0: the replica's own
            return {**base, "CUDA_VISIBLE_DEVICES": ",".join(self.gpus)}
        return {**base, "VLLM_CPU_OMP_THREADS_BIND": str(self.core)}


def block_size(replicas: int) -> int:
    """The ports a fleet of `replicas` takes: the router's, one per replica, then the router's metrics exporter's."""
    return replicas + 2


def place_replicas(replicas: int, cores: list[int], gpus: list[str], gpus_per_replica: int = 1,
                   first_core: int = 0) -> list[Placement]:
    """One placement per replica: on a GPU host `gpus_per_replica` GPUs each (the model's tensor parallel size),
    none shared, else a core each (round robin from the `first_core`-th when the replicas outnumber the cores).
    Raises ValueError when the GPUs do not go round: two replicas on one GPU would each size its KV cache for the
    whole GPU."""
    if not gpus:
        return [Placement(core=cores[(first_core + i) % len(cores)]) for i in range(replicas)]
    if replicas * gpus_per_replica > len(gpus):
        raise ValueError(f"{replicas} replica(s) of {gpus_per_replica} GPU(s) each need {replicas * gpus_per_replica} "
                         f"GPUs; this host shows {len(gpus)} ({','.join(gpus)}): lower the replicas "
                         "(BATCH_FLEET_REPLICAS, --replicas) or the model's tensor_parallel_size")
    return [Placement(gpus=tuple(gpus[i * gpus_per_replica:(i + 1) * gpus_per_replica])) for i in range(replicas)]


@dataclass
class Fleet:
    """The replicas of one model on ports `port + 1 ...`, the router on `port` and its metrics exporter on the block's
    last port (`port` 0: a free block of ports).

    A fleet may sleep: its replicas stop and give their memory back while the router stays on its port (answering
    503, which the runs' engine client waits out), and `wake` starts them again."""

    model: str
    replicas: int
    port: int
    command_for_port: Callable[[int], list[str]]  # a replica's server command on a port
    policy: str  # one of settings.POLICIES (BATCH_FLEET_POLICY is checked against them)
    host: str
    log_dir: Path = Path("data/logs/fleet")
    gpus_per_replica: int = 1  # the model's tensor (times pipeline) parallel size
    gpus: list[str] | None = None  # the GPUs to place replicas on; None: those this host shows (visible_gpus)
    first_core: int = 0  # on a CPU, the core (of those this process may use) its first replica is pinned to
    children: Children = field(default_factory=Children)
    asleep: bool = field(init=False, default=False)
    placements: list[Placement] = field(init=False, default_factory=list)
    spare_gpus: list[str] | None = field(init=False, default=None)  # GPUs no replica took; None on a CPU
    _should_stop: Callable[[], bool] = field(default=lambda: False, repr=False)

    def __post_init__(self) -> None:
        from batch_dagster.engine.hardware import visible_gpus

        gpus = visible_gpus() if self.gpus is None else self.gpus
        self.placements = place_replicas(self.replicas, cores(), gpus, self.gpus_per_replica, self.first_core)
        if gpus:
            self.spare_gpus = gpus[self.replicas * self.gpus_per_replica:]
        if self.port == 0:
            self.port = free_port_block(block_size(self.replicas), self.host)

    @property
    def url(self) -> str:
        """The router's base URL (without /v1)."""
        return f"http://{self.host}:{self.port}"

    @property
    def server_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.port + 1 + i}" for i in range(self.replicas)]

    @property
    def metrics_port(self) -> int:
        """The router's Prometheus exporter (vllm-router binds 29000 unless told: two routers would collide)."""
        return self.port + block_size(self.replicas) - 1

    def server_commands(self) -> list[tuple[list[str], dict[str, str]]]:
        """Each replica's command and environment, on its own GPUs or pinned to its own core."""
        return [(place.command(self.command_for_port(self.port + 1 + i)), place.env(dict(os.environ)))
                for i, place in enumerate(self.placements)]

    def router_command(self) -> list[str]:
        router = Path(sys.executable).with_name("vllm-router")
        return [str(router), "--host", self.host, "--port", str(self.port), "--policy", self.policy,
                "--worker-urls", *self.server_urls,
                # A dead replica leaves the rotation after two failed checks, two seconds apart.
                "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                "--retry-max-retries", "5", "--request-timeout-secs", "1800",
                "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                "--log-level", "warning"]

    def start(self, timeout_s: float = 600, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start the replicas, wait until each answers /health, then start the router and wait for it."""
        self.launch()
        self.wait_ready(timeout_s, should_stop)

    def launch(self) -> None:
        """Start the replicas, without waiting for them. The first time, RuntimeError, before starting any, when one
        of the fleet's ports is taken (a replica would exit at once, its reason only in its log)."""
        last = self.port + block_size(self.replicas) - 1
        if not self.children.procs and (taken := taken_ports(self.host, range(self.port, last + 1))):
            raise RuntimeError(
                f"port {', '.join(map(str, taken))} on {self.host} is in use: a fleet of {self.replicas} takes ports "
                f"{self.port} to {last} (the router, its replicas, the router's metrics); choose another port, or 0 "
                "for a free block")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        on = [f"GPU {','.join(p.gpus)}" if p.gpus else f"core {p.core}" for p in self.placements]
        log.info("%d replica(s) of %s on %s", self.replicas, self.model, "; ".join(on))
        if not self.placements[0].gpus and self.replicas > len(cores()):
            log.warning("%d replicas on %d cores: some replicas share a core", self.replicas, len(cores()))
        for i, (command, env) in enumerate(self.server_commands()):
            self.children.start(f"vllm-{i}", command, env, open(self.log_dir / f"vllm-{i}.log", "ab"))
        self.asleep = False

    def wait_ready(self, timeout_s: float = 600, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Wait until each replica answers /health, then start the router (unless it runs) and wait for it.
        Raises RuntimeError when a process exits first, TimeoutError past `timeout_s`."""
        self._should_stop = should_stop
        deadline = time.monotonic() + timeout_s
        for i, url in enumerate(self.server_urls):
            self._wait(url + "/health", deadline, f"vllm-{i}")
        if "router" not in self.children.procs:
            self.children.start("router", self.router_command(), dict(os.environ),
                                open(self.log_dir / "router.log", "ab"))
        self._wait(self.url + "/v1/models", deadline, "router")

    def ready(self) -> bool:
        """Whether every replica answers /health now (one quick look each)."""
        for url in self.server_urls:
            try:
                if httpx.get(url + "/health", timeout=2).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def sleep(self) -> None:
        """Stop the replicas (their memory goes back to the machine); the router stays on its port."""
        replicas = [name for name in self.children.procs if name != "router"]
        self.children.stop(names=replicas)
        self.asleep = True
        log.info("%s: replicas stopped (idle); the router stays at %s", self.model, self.url)

    def wake(self) -> None:
        """Start the replicas of a sleeping fleet again; the router takes them back once they answer /health."""
        log.info("%s: starting its replicas again", self.model)
        self.launch()

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
            log.warning("%s of %s exited (code %s); restarting it", name, self.model,
                        self.children.procs[name].returncode)
            if name == "router":
                command, env = self.router_command(), dict(os.environ)
            else:
                command, env = self.server_commands()[int(name.removeprefix("vllm-"))]
            self.children.start(name, command, env, open(self.log_dir / f"{name}.log", "ab"))

    def stop(self) -> None:
        self.children.stop()


def model_fleet(settings: Any, model: str, replicas: int, port: int, policy: str, host: str, *,
                gpus: list[str] | None = None, first_core: int = 0) -> Fleet:
    """The fleet of a registry model: its servers started with the registry's settings, each on as many GPUs as
    the model's parallelism takes (of `gpus`; None: those this host shows) or a core (from the `first_core`-th),
    logging under $BATCH_DATA_DIR/logs/fleet-MODEL/. Raises UnknownModel for a model not in the registry."""
    from batch_dagster.engine.models import Models
    from batch_dagster.engine.server import server_command

    models = Models.from_settings(settings)
    spec = models.spec(model)
    path = models.path(spec)
    return Fleet(model, replicas, port, lambda p: server_command(spec, path, host, p), policy, host,
                 log_dir=settings.data_dir / "logs" / f"fleet-{model}",
                 gpus_per_replica=spec.tensor_parallel_size * int(spec.engine_args.get("pipeline_parallel_size", 1)),
                 gpus=gpus, first_core=first_core)
