"""A count worker's renderer for the fast tiers (engine/counting.py FACTORY): one token per word of the prompt text,
as the fake engine bills, so the estimates of tests/api and tests/pipeline are exact for it; it loads no vLLM.

Sentinels in a message's text: REFUSE is a body its template refuses (a 400, counted as refused); HANG renders for
ever (the count's deadline must stop it, its worker killed).
"""

from __future__ import annotations

import time
from typing import Any

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.responses import chat_body
from batch_dagster.engine.models import Models
from batch_dagster.engine.render import Refused


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise Refused("Message content must be a string or a list of content parts.", "messages")


class WordRenderer:
    def __init__(self, models: Models):
        self.models = models

    def load(self, model: str) -> int:
        return self.models.spec(model).max_model_len or 2048

    def count(self, model: str, endpoint: str, body: dict[str, Any]) -> list[int]:
        if endpoint == c.RESPONSES:
            endpoint, body = c.CHAT, chat_body(body)
        if endpoint == c.CHAT:
            if any(not isinstance(m, dict) or not isinstance(m.get("role"), str) for m in body["messages"]):
                raise Refused("Each message needs a role.", "messages")
            text = " ".join(_text(m.get("content")) for m in body["messages"])
            if "REFUSE" in text:
                raise Refused("This template refuses REFUSE.")
            if "HANG" in text:
                time.sleep(3600)
            return [len(text.split())]
        prompts = body["prompt"] if isinstance(body["prompt"], list) and not all(
            isinstance(t, int) for t in body["prompt"]) else [body["prompt"]]
        return [len(p) if isinstance(p, list) else len(p.split()) for p in prompts]
