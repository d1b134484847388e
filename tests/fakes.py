"""A small fake engine for fast pipeline tests: deterministic answers, countable calls, injectable faults."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from batch_dagster.batchfile import contract as c
from batch_dagster.engine import translate as t
from batch_dagster.engine.base import EngineCrash, Line, Request
from batch_dagster.resources import VLLMResource


@dataclass
class FakeEngine:
    """Echoes the last user message; `crash_times` shards crash before it behaves."""

    crash_times: int = 0
    calls: list[list[str]] = field(default_factory=list)
    on_call: Callable[[int], None] | None = None  # called with the call number, e.g. to cancel mid-batch

    def run(self, endpoint: str, requests: Sequence[Request], on_progress: Callable[[int], None] | None = None) -> list[Line]:
        self.calls.append([cid for cid, _ in requests])
        if self.on_call is not None:
            self.on_call(len(self.calls))
        if self.crash_times > 0:
            self.crash_times -= 1
            raise EngineCrash("fake engine died")
        lines = []
        for cid, body in requests:
            if body.get("temperature", 1) < 0:
                lines.append(t.RequestError("temperature must be non-negative", param="temperature").line(cid))
                continue
            text = str(body["messages"][-1]["content"]) if endpoint == c.CHAT else str(body.get("prompt"))
            words = text.split()
            out = " ".join(words[: body.get("max_tokens", 16)])
            choice = t.Choice(f"echo: {out}", "stop", len(words[: body.get("max_tokens", 16)]) + 1)
            lines.append(c.success_line(cid, t.chat_completion(body["model"], [choice], len(words))))
            if on_progress is not None:
                on_progress(1)
        return lines


FAKES: dict[str, FakeEngine] = {}


class FakeVLLM(VLLMResource):
    """The vLLM resource with the engine swapped for `FAKES[fake]`."""

    fake: str = "default"

    def engine(self, model: str) -> Any:
        self.spec(model)
        return FAKES[self.fake]

    def reset(self, model: str) -> None:
        pass

    def model_record(self, model: str) -> dict[str, Any]:
        return {"model": model, "revision": "fake", "engine_mode": "fake", "engine_settings": {},
                "vllm_version": "none", "seed": 0}
