"""`make serve`'s warm fleets: one per model of BATCH_FLEET_MODELS, each behind its own vllm-router on a block of
ports of its own, so several live on one machine. A fleet whose model has had no batch and no interactive call for
BATCH_FLEET_IDLE_S stops its replicas (their memory goes back) and starts them again on its model's next one; the
store records each fleet's state and its last start, which the ETA adds while the fleet is not warm."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batch_dagster.db import Database
from batch_dagster.db.fleets import busy_models, called_models, forget_fleets, record_fleet

from .fleet import Fleet, block_size, model_fleet

log = logging.getLogger("batch_dagster.serve.fleets")
DEMAND_EVERY_S = 2.0  # how often the store is asked which models have work


@dataclass
class WarmFleets:
    """The fleets, by model; the store their states go to; how long one stays warm with nothing to do (0: always)."""

    fleets: dict[str, Fleet]
    store: Database | None = None
    idle_s: float = 0.0
    spare_gpus: list[str] | None = None  # GPUs no replica took (None on a CPU): the in-process runs' own
    last_busy: dict[str, float] = field(default_factory=dict)  # monotonic
    waking: dict[str, float] = field(default_factory=dict)  # model -> when its start began (monotonic)
    _asked_at: float = 0.0
    _called_since: int = field(default_factory=lambda: int(time.time()))  # interactive calls since then count as work

    @classmethod
    def plan(cls, settings: Any, models: list[str], *, host: str, store: Database | None = None,
             gpus: list[str] | None = None, make: Callable[..., Fleet] = model_fleet) -> WarmFleets:
        """A fleet for each of `models` (each is a registry model: Settings.fleet_models checks them), its replicas
        on GPUs of their own (of `gpus`; None: those the host shows) or cores from where the last fleet's ended, on
        a free block of ports each, or blocks one after another from BATCH_FLEET_PORT. ValueError when the GPUs do
        not go round."""
        from batch_dagster.engine.hardware import visible_gpus

        host_gpus = visible_gpus() if gpus is None else list(gpus)
        left = host_gpus
        fleets: dict[str, Fleet] = {}
        port, core = settings.fleet_port, 0
        for model in models:
            if host_gpus and not left:
                raise ValueError(f"no GPU is left for the fleet of {model}: the fleets before it took the "
                                 f"{len(host_gpus)} this host shows; lower BATCH_FLEET_REPLICAS or list fewer models "
                                 "in BATCH_FLEET_MODELS")
            fleet = make(settings, model, settings.fleet_replicas, port, settings.fleet_policy, host, gpus=left,
                         first_core=core)
            fleets[model] = fleet
            left = fleet.spare_gpus or []
            core += fleet.replicas
            if port:
                port += block_size(fleet.replicas)
        return cls(fleets, store, settings.fleet_idle_s, left if host_gpus else None)

    def start(self, should_stop: Callable[[], bool]) -> None:
        """Start every fleet's replicas at once, then wait for each; a fleet that fails to start is stopped and
        left out (its model's batches run in their runs' processes), with the reason logged. KeyboardInterrupt when
        `should_stop` says so meanwhile."""
        started = time.monotonic()
        refused: dict[str, RuntimeError] = {}
        for model, fleet in self.fleets.items():
            try:
                fleet.launch()
                self._record(fleet, "starting")
            except RuntimeError as exc:  # one of its ports is taken: nothing of it started
                refused[model] = exc
        for model, fleet in list(self.fleets.items()):
            try:
                if model in refused:
                    raise refused[model]
                fleet.wait_ready(should_stop=should_stop)
            except (RuntimeError, TimeoutError) as exc:
                log.error("the fleet of %s did not start (%s); its batches run in their runs' processes", model, exc)
                fleet.stop()
                self._record(fleet, "failed")
                del self.fleets[model]
                continue
            self._record(fleet, "warm", time.monotonic() - started)
            self.last_busy[model] = time.monotonic()
            log.info("warm fleet: %d replica(s) of %s behind vllm-router at %s/v1 (its metrics on port %d)",
                     fleet.replicas, model, fleet.url, fleet.metrics_port)

    def urls(self) -> dict[str, str]:
        """Each running fleet's router, by model: what the daemon's runs send their requests to."""
        return {model: fleet.url for model, fleet in self.fleets.items()}

    def tick(self) -> None:
        """Restart what died; put to sleep the fleets idle for idle_s; wake those whose model has work again (a batch
        not ended, or an interactive call the API forwarded or was asked for)."""
        for fleet in self.fleets.values():
            fleet.heal()
        now = time.monotonic()
        for model, began in list(self.waking.items()):
            if self.fleets[model].ready():
                del self.waking[model]
                self._record(self.fleets[model], "warm", now - began)
                log.info("%s: its fleet is warm again after %.0f s", model, now - began)
        if self.idle_s <= 0 or self.store is None or now - self._asked_at < DEMAND_EVERY_S:
            return
        self._asked_at = now
        asked = int(time.time()) - 1  # whole seconds: a call in this second is seen again next time, never missed
        try:
            with self.store.session() as session:
                busy = busy_models(session, list(self.fleets)) | called_models(session, list(self.fleets),
                                                                              self._called_since)
        except Exception as exc:  # the store restarting: ask again next time, change nothing meanwhile
            log.warning("could not ask the store which models have work: %r", exc)
            return
        self._called_since = asked
        for model, fleet in self.fleets.items():
            if model in busy:
                self.last_busy[model] = now
                if fleet.asleep:
                    fleet.wake()
                    self.waking[model] = now
                    self._record(fleet, "starting")
            elif not fleet.asleep and model not in self.waking and now - self.last_busy.get(model, now) >= self.idle_s:
                log.info("%s: no batch for %.0f s; its fleet sleeps until the next one", model, self.idle_s)
                fleet.sleep()
                self._record(fleet, "asleep")

    def stop(self) -> None:
        for fleet in self.fleets.values():
            fleet.stop()
        if self.store is not None:
            try:
                with self.store.session() as session:
                    forget_fleets(session)
            except Exception as exc:
                log.warning("could not clear the fleets' records: %r", exc)

    def _record(self, fleet: Fleet, state: str, start_s: float | None = None) -> None:
        if self.store is None:
            return
        try:
            with self.store.session() as session:
                record_fleet(session, fleet.model, fleet.url, state, start_s)
        except Exception as exc:  # the fleet runs whatever the store says; the ETA reads it when it can
            log.warning("could not record the fleet of %s as %s: %r", fleet.model, state, exc)


def scrape_targets(api: str, fleets: dict[str, Fleet]) -> list[dict[str, Any]]:
    """Prometheus file_sd targets for what serve runs: the API's metrics listener (`api`), and each fleet's router
    exporter and replicas."""
    targets: list[dict[str, Any]] = [{"targets": [api], "labels": {"component": "api"}}]
    for model, fleet in fleets.items():
        targets.append({"targets": [f"{fleet.host}:{fleet.metrics_port}"],
                        "labels": {"component": "vllm-router", "model": model}})
        targets.append({"targets": [url.removeprefix("http://") for url in fleet.server_urls],
                        "labels": {"component": "vllm-worker", "model": model}})
    return targets


def write_targets(path: Path, targets: list[dict[str, Any]]) -> None:
    """Write the targets where a Prometheus file_sd_config reads them (atomically: it rereads on change)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(targets, indent=2) + "\n")
    partial.replace(path)
