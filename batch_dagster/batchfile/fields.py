"""Every request field of every endpoint, and what happens to it: honored, or refused at validation, and why.

The one table that validation refuses bodies by (bodies.check_body) and that docs/formats.md lists (`markdown`).
It names every field of the official openai SDK's request types and of vLLM's request models (tests/core/
test_fields.py checks both); a field in neither is refused as unknown, as OpenAI refuses one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import contract as c
from .image_sources import ImageSources


@dataclass(frozen=True)
class Serves:
    """What a model takes, as the registry says: its endpoints, tool calls (a tool-call parser is named),
    reasoning (a reasoning parser is named), and image parts (how many per request; 0: none), from which sources."""

    endpoints: tuple[str, ...] = ()
    tool_calls: bool = False
    reasoning: bool = False
    images: int = 0
    # Where its images may come from (the operator's, not the registry's); None: not known here, not checked.
    image_sources: ImageSources | None = None


# Why a field's value (in its body) is refused for a model that `serves` (None: not known), or None when it is not.
# Never called with a null value: null means "not set".
Refuse = Callable[[Any, dict[str, Any], Serves | None], str | None]


@dataclass(frozen=True)
class Field:
    """What one body field does: `honored` (reaches the engine with its effect) or refused with `note` as the why.

    An honored field may still be refused for some values or models (`refuse`), as `when` says in words.
    """

    honored: bool
    note: str
    refuse: Refuse | None = None
    when: str = ""


def honored(note: str, refuse: Refuse | None = None, when: str = "") -> Field:
    return Field(True, note, refuse, when)


def refused(why: str) -> Field:
    return Field(False, why)


# -- the conditions -----------------------------------------------------------------------------------------------

NO_TOOL_PARSER = "the registry names no tool_call_parser for this model, so it cannot call tools"
NO_REASONING = "the registry names no reasoning_parser for this model: it is not a reasoning model"


def _true(why: str) -> Refuse:
    return lambda value, body, serves: why if value is True else None


def _tool_calls(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    """Tools may be called (`tool_choice` anything but "none"; OpenAI's default with tools is "auto") only where the
    model has a tool-call parser: vLLM refuses it otherwise."""
    if body.get("tool_choice") == "none" or serves is None or serves.tool_calls:
        return None
    return NO_TOOL_PARSER


def _needs_reasoning(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    return NO_REASONING if serves is not None and not serves.reasoning else None


def _text_only(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    if isinstance(value, list) and all(m == "text" for m in value):
        return None
    return "only text is generated here (no audio output)"


def _auto_tier(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    return None if value in ("auto", "default") else "a batch runs in the batch tier; only 'auto' and 'default' name it"


def _images(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    if serves is None or serves.images:
        return None
    return "the registry does not mark this model as taking images"


def _logprobs_only(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    if isinstance(value, list) and all(v == "message.output_text.logprobs" for v in value):
        return None
    return "only 'message.output_text.logprobs' can be included (no stored reasoning, no built-in tools)"


# -- the fields ---------------------------------------------------------------------------------------------------

STREAMS = "a batch line holds one answer; it never streams"
STORED = "a batch line is not stored: nothing can refer to it later"
NOT_STORED_CHAT = ("chat completions keep metadata only when stored, and a batch line is not stored "
                   "(tag it by custom_id)")
ID_BY_BATCH = "each line's ids are the batch's (its custom_id is yours)"
PRIORITY = ("the engine serves a shard first come, first served (prefix order); order batches with the batch's "
            "priority")
NO_TRANSFER = "no disaggregated prefill or encoder cache is configured"
NO_PLUGINS = "no custom logits processor is loaded"
NO_MM_KWARGS = "multimodal processing is the operator's (the registry), not a request's"
NO_SESSION = "a batch line belongs to no session"
CACHE_KEY = "the prefix cache needs no key: shards group requests by their shared prefixes, and the cache finds them"
IDENTIFIER = "an identifier for OpenAI's abuse monitoring; none runs here (use `user`, which vLLM takes)"
# vllm-project/vllm#51789 (open): a request with logprob_token_ids in the same engine step as one with top logprobs
# replaces the other's top logprobs with its own ids' (or padding); seen in this repo's parity test, both engines.
MIXED_LOGPROBS = ("vLLM here returns wrong top logprobs to the other requests of an engine step that holds it "
                  "(vllm-project/vllm#51789): ask for `top_logprobs` (up to 20) instead")
CACHE_RETENTION = "the engine's prefix cache is kept by the engine, not per request"

SAMPLING = {
    "model": honored("the registry model that answers (one per file)"),
    "temperature": honored("sampling temperature; 0 is greedy"),
    "top_p": honored("nucleus sampling (vLLM refuses 0 with a 400 line)"),
    "n": honored("how many choices"),
    "stop": honored("stop strings; `stop_reason` names the one met"),
    "seed": honored("the sampling seed: the same seed gives the same answer on both engines"),
    "presence_penalty": honored("penalizes tokens already present"),
    "frequency_penalty": honored("penalizes tokens by their count"),
    "logit_bias": honored("token id -> bias added to its logit"),
    "user": honored("an end-user id; it does not change the answer (nor at OpenAI)"),
    "stream": honored("`false` only", _true(STREAMS), "for `true`"),
    "stream_options": refused(STREAMS),
    # vLLM's sampling extras.
    "top_k": honored("top-k sampling (vLLM); -1 or 0: off"),
    "min_p": honored("min-p sampling (vLLM)"),
    "repetition_penalty": honored("penalizes repeated tokens (vLLM)"),
    "min_tokens": honored("the fewest tokens before a stop (vLLM)"),
    "ignore_eos": honored("generate past the end-of-sequence token (vLLM)"),
    "stop_token_ids": honored("stop token ids (vLLM)"),
    "include_stop_str_in_output": honored("keep the stop string in the answer (vLLM)"),
    "skip_special_tokens": honored("`false` keeps special tokens in the text (vLLM)"),
    "spaces_between_special_tokens": refused("vLLM's detokenizer here ignores it (it changes no answer)"),
    "bad_words": honored("words never generated (vLLM)"),
    "allowed_token_ids": honored("the only tokens generated (vLLM)"),
    "prompt_logprobs": honored("log probabilities of the prompt's tokens (vLLM)"),
    "return_token_ids": honored("the answer's and prompt's token ids in the body (vLLM)"),
    "return_tokens_as_token_ids": honored("logprobs name tokens as `token_id:N` (vLLM)"),
    "logprob_token_ids": refused(MIXED_LOGPROBS),
    "return_token_offsets": refused("vLLM returns no offsets for a non-streamed answer"),
    "truncate_prompt_tokens": honored("keep only the prompt's last (or first) N tokens (vLLM)"),
    "truncation_side": honored("which side `truncate_prompt_tokens` cuts (vLLM)"),
    "structured_outputs": honored("vLLM's constraints: json, regex, choice, grammar (xgrammar)"),
    "use_beam_search": honored("beam search, `n` beams (vLLM)"),
    "length_penalty": honored("beam search's length penalty (vLLM)"),
    "add_special_tokens": honored("add the tokenizer's special tokens to the prompt (vLLM)"),
    "priority": refused(PRIORITY),
    "request_id": refused(ID_BY_BATCH),
    "cache_salt": honored("a part of the prefix cache of its own, within its key's: the engine gets a hash of the "
                          "key's scope and this value (every request is salted by its key's scope anyway)"),
    "kv_transfer_params": refused(NO_TRANSFER),
    "ec_transfer_params": refused(NO_TRANSFER),
    "vllm_xargs": refused(NO_PLUGINS),
    "watermarking": refused("no watermarking is configured"),
    "repetition_detection": refused("not offered in batches (it stops answers early by a heuristic)"),
    "thinking_token_budget": refused("it needs vLLM's --reasoning-config, which the registry does not set"),
    "session_id": refused(NO_SESSION),
    "stream_interval": refused(STREAMS),
    "mm_payload": refused(NO_MM_KWARGS),
    "return_mm_kwargs": refused(NO_MM_KWARGS),
    "routed_experts_prompt_start": refused("a mixture-of-experts debugging switch"),
}

_CHAT_ONLY = {
    "messages": honored("the conversation; content parts `text`, and `image_url` where the model takes images"),
    "max_tokens": honored("the most tokens to generate (capped at the context left)"),
    "max_completion_tokens": honored("as `max_tokens` (it wins when both are set)"),
    "logprobs": honored("log probabilities of the answer's tokens"),
    "top_logprobs": honored("the most likely tokens at each position, with `logprobs`"),
    "response_format": honored("`text`, `json_object` or `json_schema` (strict), enforced by xgrammar"),
    "tools": honored("function tools the model may call", _tool_calls, "on a model without a tool-call parser "
                                                                       "(unless `tool_choice` is `none`)"),
    "tool_choice": honored("`none`, `auto`, `required` or a named function", _tool_calls,
                           "for anything but `none` on a model without a tool-call parser"),
    "parallel_tool_calls": honored("`false`: at most one tool call"),
    "reasoning_effort": honored("passed to the chat template", _needs_reasoning, "on a model without a reasoning "
                                                                                 "parser"),
    "include_reasoning": honored("`false` leaves the reasoning out of the answer (vLLM)", _needs_reasoning,
                                 "on a model without a reasoning parser"),
    "enable_thinking": honored("a switch of the chat template (Qwen3), as `chat_template_kwargs.enable_thinking`"),
    "chat_template_kwargs": honored("variables for the model's chat template (vLLM)"),
    "add_generation_prompt": honored("`false` leaves out the assistant turn's opening (vLLM)"),
    "continue_final_message": honored("continue the last assistant message instead of starting one (vLLM)"),
    "echo": honored("the last assistant message's text before the answer (vLLM)"),
    "documents": honored("documents for chat templates that read them (retrieval templates; vLLM)"),
    "return_prompt_text": honored("the prompt's text, as the template made it, in the body (vLLM)"),
    "modalities": honored("`[\"text\"]` only", _text_only, "for anything else"),
    "store": honored("`false` only", _true(STORED), "for `true`"),
    "metadata": refused(NOT_STORED_CHAT),
    "service_tier": honored("`auto` or `default`", _auto_tier, "for any other tier"),
    "chat_template": refused("a request may not replace the model's chat template (vLLM refuses it too)"),
    "mm_processor_kwargs": refused(NO_MM_KWARGS),
    "media_io_kwargs": refused(NO_MM_KWARGS),
    "audio": refused("no audio output: the registry's models answer in text"),
    "prediction": refused("predicted outputs are not implemented by vLLM"),
    "verbosity": refused("a setting of OpenAI's own models; vLLM has none"),
    "web_search_options": refused("no web search runs here"),
    "functions": refused("deprecated by OpenAI: use `tools`"),
    "function_call": refused("deprecated by OpenAI: use `tool_choice`"),
    "moderation": refused("no moderation runs here"),
    "prompt_cache_key": refused(CACHE_KEY),
    "prompt_cache_options": refused(CACHE_RETENTION),
    "prompt_cache_retention": refused(CACHE_RETENTION),
    "safety_identifier": refused(IDENTIFIER),
}

_COMPLETIONS_ONLY = {
    "prompt": honored("text, texts, token ids or lists of token ids"),
    "max_tokens": honored("the most tokens to generate (16 when not set, as at OpenAI)"),
    "logprobs": honored("log probabilities of the answer's tokens, with the N most likely (0 to 5)"),
    "echo": honored("the prompt before the answer"),
    "response_format": honored("`json_object` or `json_schema` (vLLM), enforced by xgrammar"),
    "best_of": refused("vLLM's engine no longer implements best_of: use `n` and pick"),
    "suffix": refused("no fill-in-the-middle model is served (vLLM refuses it)"),
    "prompt_embeds": refused("prompt embeddings need vLLM's --enable-prompt-embeds, which the registry does not set"),
}

_EMBEDDINGS = {
    "model": SAMPLING["model"],
    "input": honored("text, texts, token ids or lists of token ids"),
    "encoding_format": honored("`float` or `base64`"),
    "dimensions": refused("the registry's embedding models give their full size only (no Matryoshka model)"),
    "user": SAMPLING["user"],
    "embed_dtype": honored("the number type of `base64` embeddings (vLLM)"),
    "endianness": honored("the byte order of `base64` embeddings (vLLM)"),
    "use_activation": honored("`false`: the embedding before normalization (vLLM)"),
    "truncate_prompt_tokens": SAMPLING["truncate_prompt_tokens"],
    "truncation_side": SAMPLING["truncation_side"],
    "add_special_tokens": SAMPLING["add_special_tokens"],
    "messages": refused("the embedding models here have no chat template: embed `input`"),
    "chat_template": _CHAT_ONLY["chat_template"],
    "chat_template_kwargs": refused("the embedding models here have no chat template"),
    "add_generation_prompt": refused("the embedding models here have no chat template"),
    "continue_final_message": refused("the embedding models here have no chat template"),
    "padding": refused("vLLM's switch for late-interaction models; none is served"),
    "priority": SAMPLING["priority"],
    "request_id": SAMPLING["request_id"],
    "cache_salt": SAMPLING["cache_salt"],
    "mm_processor_kwargs": refused(NO_MM_KWARGS),
    "media_io_kwargs": refused(NO_MM_KWARGS),
}

_RESPONSES = {
    "model": SAMPLING["model"],
    "input": honored("a string, or message, `function_call` and `function_call_output` items; content parts "
                     "`input_text`/`output_text`, and `input_image` where the model takes images"),
    "instructions": honored("a system message before the input"),
    "max_output_tokens": honored("the most tokens to generate; `status: incomplete` when reached"),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "top_logprobs": honored("the most likely tokens at each position (with `include`)"),
    "include": honored("`message.output_text.logprobs`", _logprobs_only, "for anything else"),
    "metadata": honored("echoed in the `response` object"),
    "user": SAMPLING["user"],
    "text": honored("`format`: `text`, `json_object` or `json_schema` (strict), enforced by xgrammar"),
    "tools": honored("function tools the model may call", _tool_calls, "on a model without a tool-call parser "
                                                                       "(unless `tool_choice` is `none`)"),
    "tool_choice": _CHAT_ONLY["tool_choice"],
    "parallel_tool_calls": _CHAT_ONLY["parallel_tool_calls"],
    "truncation": honored("`auto` cuts a prompt too long for the context from the start instead of failing"),
    "reasoning": honored("the reasoning `effort`, passed to the chat template", _needs_reasoning,
                         "on a model without a reasoning parser"),
    "include_reasoning": _CHAT_ONLY["include_reasoning"],
    "service_tier": _CHAT_ONLY["service_tier"],
    "store": _CHAT_ONLY["store"],
    "stream": SAMPLING["stream"],
    "stream_options": SAMPLING["stream_options"],
    "previous_response_id": refused("a batch request cannot continue a stored response: give the whole input"),
    "conversation": refused("a batch request cannot continue a stored conversation: give the whole input"),
    "background": refused("batch requests already run in the background"),
    "background_options": refused("batch requests already run in the background"),
    "prompt": refused("stored prompt templates are OpenAI's (vLLM refuses them)"),
    "max_tool_calls": refused("it bounds built-in tools, and none runs here"),
    "context_management": refused("no server-side context is kept for a batch line"),
    "access_programs": refused("an OpenAI account setting"),
    "image": refused("no image generation here"),
    "moderation": _CHAT_ONLY["moderation"],
    "prompt_cache_key": _CHAT_ONLY["prompt_cache_key"],
    "prompt_cache_options": _CHAT_ONLY["prompt_cache_options"],
    "prompt_cache_retention": _CHAT_ONLY["prompt_cache_retention"],
    "safety_identifier": _CHAT_ONLY["safety_identifier"],
    "chat_template_kwargs": _CHAT_ONLY["chat_template_kwargs"],
    "enable_response_messages": honored("the prompt and answer as chat messages in the `response` (vLLM)"),
    "previous_input_messages": refused("a batch request cannot continue a stored conversation: give the whole input"),
    "mm_processor_kwargs": refused(NO_MM_KWARGS),
    "media_io_kwargs": refused(NO_MM_KWARGS),
    **{name: SAMPLING[name] for name in (
        "seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
        "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "stop_token_ids", "structured_outputs",
        "priority", "request_id", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
        "watermarking", "session_id", "mm_payload", "return_mm_kwargs")},
}

NO_SCORE_TEMPLATE = "it goes to a score template, and the registry's scoring models (embedding models) have none"
OTHER_NAMES = "vLLM's other name for what this endpoint takes as {name}: use {name}"
_SCORING = {
    "model": SAMPLING["model"],
    "documents": honored("the texts scored: a string or strings"),
    "user": SAMPLING["user"],
    "truncate_prompt_tokens": honored("keep only each text's last (or first) N tokens (vLLM)"),
    "truncation_side": SAMPLING["truncation_side"],
    "max_tokens_per_query": honored("cut each query to N tokens (vLLM; 0: not cut)"),
    "max_tokens_per_doc": honored("cut each document to N tokens (vLLM; 0: not cut)"),
    "use_activation": refused("an embedding model's score is a cosine similarity, with no activation to switch"),
    "instruction": refused(NO_SCORE_TEMPLATE),
    "chat_template_kwargs": refused(NO_SCORE_TEMPLATE),
    "padding": _EMBEDDINGS["padding"],
    "priority": SAMPLING["priority"],
    "request_id": SAMPLING["request_id"],
    "cache_salt": SAMPLING["cache_salt"],
    "mm_processor_kwargs": refused(NO_MM_KWARGS),
}
_SCORE = {
    **_SCORING,
    "queries": honored("the text(s) each document is scored against: one, or one per document"),
    "text_1": refused(OTHER_NAMES.format(name="queries")),
    "data_1": refused(OTHER_NAMES.format(name="queries")),
    "text_2": refused(OTHER_NAMES.format(name="documents")),
    "data_2": refused(OTHER_NAMES.format(name="documents")),
    "items": refused(OTHER_NAMES.format(name="documents")),
}
_RERANK = {
    **_SCORING,
    "query": honored("the text the documents are ranked for"),
    "top_n": honored("how many of the best documents to return (0: all)"),
}

FIELDS: dict[str, dict[str, Field]] = {
    c.CHAT: {**SAMPLING, **_CHAT_ONLY},
    c.COMPLETIONS: {**SAMPLING, **_COMPLETIONS_ONLY},
    c.EMBEDDINGS: _EMBEDDINGS,
    c.RESPONSES: _RESPONSES,
    c.SCORE: _SCORE,
    c.RERANK: _RERANK,
}

UNKNOWN = "it is not a request field of {url}"

# Content parts of chat messages and of /v1/responses input items, and what happens to each.
PARTS: dict[str, Field] = {
    "text": honored("text"),
    "input_text": honored("text (/v1/responses)"),
    "output_text": honored("an earlier answer's text (/v1/responses)"),
    "refusal": honored("an earlier refusal, given to the chat template as text"),
    "image_url": honored("an image: a data URL, or an http(s) URL on a host the operator allows", _images,
                         "on a model the registry does not mark as taking images"),
    "input_image": honored("an image (/v1/responses), as `image_url`", _images,
                           "on a model the registry does not mark as taking images"),
    "input_audio": refused("no model here takes audio"),
    "file": refused("file inputs are not served: send their text, or an image part"),
    "input_file": refused("file inputs are not served: send their text, or an image part"),
}
SERVED_PARTS = frozenset(PARTS)


def part_refusal(kind: str, serves: Serves | None) -> str | None:
    """Why a content part of type `kind` is refused for a model that `serves`, or None."""
    part = PARTS[kind]
    if not part.honored:
        return part.note
    return part.refuse(kind, {}, serves) if part.refuse is not None else None


def refusal(url: str, name: str, body: dict[str, Any], serves: Serves | None) -> str | None:
    """Why `body[name]` is refused on `url` for a model that `serves` (None: not known), or None."""
    field = FIELDS[url].get(name)
    value = body[name]
    if field is None:
        return UNKNOWN.format(url=url)
    if not field.honored:
        return field.note
    return field.refuse(value, body, serves) if field.refuse is not None else None


def counts() -> dict[str, tuple[int, int]]:
    """(honored, refused) fields per endpoint."""
    return {url: (sum(f.honored for f in table.values()), sum(not f.honored for f in table.values()))
            for url, table in FIELDS.items()}
