"""The one place where OpenAI request bodies become engine parameters and engine results become
OpenAI response bodies. Shared by the offline and server engines so both write the same lines.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import responses
from batch_dagster.batchfile.bodies import BodyError, check_body

# OpenAI sampling fields, plus vLLM's extras that its server also accepts in a body.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
)
PROMPT_PARAM = {c.CHAT: "messages", c.COMPLETIONS: "prompt", c.EMBEDDINGS: "input", c.RESPONSES: "input"}


class RequestError(Exception):
    """A request the engine rejects: becomes a 400 line in the error file."""

    def __init__(self, message: str, *, code: str = c.INVALID_REQUEST, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param

    def line(self, custom_id: str) -> dict[str, Any]:
        return c.request_error_line(custom_id, self.code, str(self), param=self.param)


def check(endpoint: str, body: dict[str, Any]) -> None:
    """Validation's type and range checks of the body, again: a request validation reported as mistyped
    is stored like any other and ends here, as its own 400 line, before it reaches an engine."""
    if endpoint == c.RESPONSES:
        problems = responses.body_problems(body)
        if problems:
            message, param = problems[0]
            raise RequestError(message, param=param.removeprefix("body."))
        return
    try:
        check_body(endpoint, body)
    except BodyError as exc:
        raise RequestError(str(exc), param=exc.param.removeprefix("body.")) from None


def text_of(content: Any) -> str:
    """A message's content as text (content parts joined), as chat templates expect."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts: list[str] = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") == "text":
                text = p.get("text", "")
                if not isinstance(text, str):
                    raise RequestError("The text of a content part must be a string.", param="messages")
                texts.append(text)
        return "".join(texts)
    raise RequestError("Message content must be a string or a list of content parts.", param="messages")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = []
    for i, m in enumerate(body["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"Message {i} must be an object with a 'role'.", param=f"messages[{i}]")
        messages.append({**m, "content": text_of(m.get("content"))})
    return messages


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Template switches such as Qwen3's `enable_thinking`, from the body or its kwargs."""
    given = body.get("chat_template_kwargs") or {}
    if not isinstance(given, dict):
        raise RequestError("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
    kwargs = dict(given)
    if "enable_thinking" in body:
        kwargs["enable_thinking"] = body["enable_thinking"]
    return kwargs


def prompt_list(body: dict[str, Any], field: str) -> list[str | list[int]]:
    """A completions `prompt` or embeddings `input` as a list of prompts (text or token ids)."""
    value = body[field]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return list(value)
    raise RequestError(f"'{field}' must be a string, a list of strings or a list of token ids.", param=field)


def max_tokens_of(endpoint: str, body: dict[str, Any], prompt_tokens: int, max_model_len: int) -> int:
    """Requested output length; the context check against `max_model_len` happens here."""
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
        raise RequestError("'max_tokens' must be a positive integer.", param="max_tokens")
    if requested is None:
        # As vLLM's server: chat may use the rest of the context; legacy completions default to 16.
        requested = (max(max_model_len - prompt_tokens, 1) if endpoint in (c.CHAT, c.RESPONSES)
                     else c.COMPLETIONS_MAX_TOKENS)
    if prompt_tokens + requested > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
            "completion). Please reduce the length of the prompt or of the completion.",
            code=c.CONTEXT_LENGTH_EXCEEDED,
            param=PROMPT_PARAM[endpoint],
        )
    return requested


def check_prompt_length(endpoint: str, prompt_tokens: int, max_model_len: int) -> None:
    if prompt_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, the input has "
            f"{prompt_tokens} tokens. Please reduce the length of the input.",
            code=c.CONTEXT_LENGTH_EXCEEDED,
            param=PROMPT_PARAM[endpoint],
        )


def sampling_kwargs(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Keyword arguments for `vllm.SamplingParams`: OpenAI defaults where the body is silent."""
    kwargs = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    kwargs.setdefault("temperature", 1.0)
    kwargs["max_tokens"] = max_tokens
    return kwargs


@dataclass
class Choice:
    """One generated sequence."""

    text: str
    finish_reason: str | None
    tokens: int
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended it


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_completion(model: str, choices: list[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                # The fields vLLM's server writes, so offline and server lines are the same.
                "message": {"role": "assistant", "content": ch.text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "reasoning": None},
                "logprobs": None,
                "finish_reason": ch.finish_reason,
                "stop_reason": ch.stop_reason,
            }
            for i, ch in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, sum(ch.tokens for ch in choices), cached_tokens),
    }


def text_completion(model: str, choices: list[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": ch.text, "logprobs": None, "finish_reason": ch.finish_reason,
             "stop_reason": ch.stop_reason}
            for i, ch in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, sum(ch.tokens for ch in choices), cached_tokens),
    }


def embedding_list(model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str) -> dict[str, Any]:
    def encode(v: list[float]) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        return v

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def encoding_format_of(body: dict[str, Any]) -> str:
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("'encoding_format' must be 'float' or 'base64'.", param="encoding_format")
    if body.get("dimensions") is not None:
        raise RequestError("'dimensions' is not supported by this model.", param="dimensions")
    return fmt
