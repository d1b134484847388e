"""Every request field of every endpoint, and what happens to it: honored, accepted with no effect here, or refused
at validation, and why.

The one table that validation refuses bodies by (bodies.check_body), that says what reaches vLLM (`for_engine`) and
that docs/formats.md lists (field_docs.py). It names every field of the official openai SDK's request types and of
vLLM's request models (tests/pipeline/test_field_matrix.py checks both); a field in neither is refused as unknown, as
OpenAI refuses one. A field is refused only when it cannot be honored and ignoring it would change the answer.
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
    # Why a tool call the request forces (tool_choice "required" or named) is refused: its parser cannot make the
    # call follow the tool's parameters (registry.UNCONSTRAINED_TOOL_PARSERS). None: it can.
    forced_tools_refused: str | None = None
    reasoning: bool = False
    images: int = 0
    # Where its images may come from (the operator's, not the registry's); None: not known here, not checked.
    image_sources: ImageSources | None = None


# Why a field's value (in its body) is refused for a model that `serves` (None: not known), or None when it is not.
# Never called with a null value: null means "not set".
Refuse = Callable[[Any, dict[str, Any], Serves | None], str | None]


# What a field's value becomes in the body vLLM gets; LEFT_OUT leaves the field out.
ToEngine = Callable[[Any], Any]
LEFT_OUT = object()

HONORED, NO_EFFECT, REFUSED = "honored", "accepted, no effect here", "refused"


@dataclass(frozen=True)
class Field:
    """What one body field does, its `kind`: HONORED (it reaches the engine with its effect), NO_EFFECT (accepted, and
    it changes nothing for the models here: `note` says why) or REFUSED (`note` is the why).

    An accepted field may still be refused for some values or models (`refuse`), as `when` says in words. It reaches
    vLLM as given, or as `to_engine` makes it: a no-op vLLM would refuse is left out before the engine.
    """

    kind: str
    note: str
    refuse: Refuse | None = None
    when: str = ""
    to_engine: ToEngine | None = None

    @property
    def accepted(self) -> bool:
        return self.kind != REFUSED

    @property
    def left_out(self) -> bool:
        return self.to_engine is _left_out


def _left_out(value: Any) -> Any:
    return LEFT_OUT


def honored(note: str, refuse: Refuse | None = None, when: str = "", to_engine: ToEngine | None = None) -> Field:
    return Field(HONORED, note, refuse, when, to_engine)


def no_effect(why: str, refuse: Refuse | None = None, when: str = "", *, left_out: bool = False) -> Field:
    """Accepted, and a no-op for the models here; `left_out`: taken out of the body before the engine (vLLM would
    refuse it, or could act on it were it configured to)."""
    return Field(NO_EFFECT, why, refuse, when, _left_out if left_out else None)


def refused(why: str) -> Field:
    return Field(REFUSED, why)


# -- the conditions -----------------------------------------------------------------------------------------------

NO_TOOL_PARSER = "the registry names no tool_call_parser for this model, so it cannot call tools"


def _true(why: str) -> Refuse:
    return lambda value, body, serves: why if value is True else None


def _tool_calls(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    """Tools may be called (`tool_choice` anything but "none"; OpenAI's default with tools is "auto") only where the
    model has a tool-call parser: vLLM refuses it otherwise."""
    if body.get("tool_choice") == "none" or serves is None or serves.tool_calls:
        return None
    return NO_TOOL_PARSER


def _tool_choice(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    """As `_tool_calls`; and a forced call ("required", or a named function) only where the model's parser makes it
    follow the tool's parameters."""
    forced = value == "required" or isinstance(value, dict)
    return _tool_calls(value, body, serves) or (serves.forced_tools_refused if forced and serves else None)


def _text_only(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    if isinstance(value, list) and all(m == "text" for m in value):
        return None
    return "only text is generated here (no audio output)"


def _best_of(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    """best_of picks the best `n` of `best_of` sequences: a no-op only when it asks for no more than `n`."""
    n = body.get("n") or 1
    if not isinstance(value, int) or value <= n:
        return None
    return "vLLM's engine no longer implements best_of: use `n` and pick"


def _images(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    if serves is None or serves.images:
        return None
    return "the registry does not mark this model as taking images"


# The template variables vLLM's filter of a request's template kwargs refuses (resolve_chat_template_kwargs, after two
# advisories): a template of the client's own, which would run in the count and in the engine's renderer (vLLM's
# server refuses it before rendering), and a switch of how the template renders.
CLIENT_TEMPLATE_KEYS = ("chat_template", "tokenize")


def _own_template(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    named = [key for key in CLIENT_TEMPLATE_KEYS if isinstance(value, dict) and key in value]
    return (f"its {named[0]!r} key is refused: a request may not replace the model's chat template or change how it "
            "renders (the keys vLLM's own filter of template kwargs refuses)") if named else None


# What vLLM's Responses protocol takes in `include` (the openai SDK's values less the web search tool's).
VLLM_INCLUDES = frozenset({"code_interpreter_call.outputs", "computer_call_output.output.image_url",
                           "file_search_call.results", "message.input_image.image_url",
                           "message.output_text.logprobs", "reasoning.encrypted_content"})


def _includes_vllm_takes(value: Any) -> Any:
    kept = [v for v in value if v in VLLM_INCLUDES]
    return kept if kept else LEFT_OUT


# -- the fields ---------------------------------------------------------------------------------------------------

STREAMS = "a batch line holds one answer; it never streams"
# Accepted, no effect here: why each changes nothing. "vLLM takes it" (or ignores it, as it does any field it does not
# know): it reaches vLLM; "left out": it is taken out of the body before the engine.
STORED = ("nothing is stored: a batch line's answer is in the output file (vLLM stores no response either unless "
          "told to, and takes it so)")
METADATA_CHAT = ("OpenAI keeps a chat completion's metadata only for stored completions, and none is stored here; "
                 "vLLM ignores it (tag lines by custom_id)")
TIER = ("a batch runs in the batch tier, whatever tier the line names; left out, so the answer's `service_tier` is "
        "vLLM's own")
ID_BY_BATCH = ("vLLM makes the answer's id from it unless an X-Request-Id header names another, which a fleet's router "
               "may send, so the same line could get other ids on the two engines (the line's custom_id is yours)")
PRIORITY = ("the engine serves a shard in the order of its shared prefixes; left out (vLLM refuses a priority "
            "unless it schedules by priority): order batches with the batch's priority")
NO_TRANSFER = ("no disaggregated prefill or encoder cache is configured; left out, so a request never names where the "
               "engine fetches from")
NO_PLUGINS = "no custom logits processor is loaded to read them, so the answer would not be the one asked for"
NO_MM_KWARGS = "multimodal processing is the operator's (the registry), not a request's"
RENDER_ONLY = "vLLM reads it on its render endpoints only and ignores it on a generated answer"
NO_SESSION = "a session groups requests for a router or a KV connector; vLLM takes it, and it changes no answer"
CACHE_KEY = ("the prefix cache needs no key (shards group requests by their shared prefixes, and the cache finds "
             "them); vLLM takes it")
CACHE_OPTIONS = "OpenAI's prompt cache settings; the engine keeps its own prefix cache, and vLLM ignores them"
IDENTIFIER = "an identifier for OpenAI's abuse monitoring, none of which runs here; vLLM ignores it"
USER = "an end-user id: vLLM takes it, and it changes no answer (nor at OpenAI)"
# vllm-project/vllm#51789 (open): a request with logprob_token_ids in the same engine step as one with top logprobs
# replaces the other's top logprobs with its own ids' (or padding); seen in this repo's parity test, both engines.
MIXED_LOGPROBS = ("vLLM here returns wrong top logprobs to the other requests of an engine step that holds it "
                  "(vllm-project/vllm#51789): ask for `top_logprobs` (up to 20) instead")

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
    "user": no_effect(USER),
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
    "spaces_between_special_tokens": no_effect("vLLM's detokenizer here ignores it; vLLM takes it"),
    "bad_words": honored("words never generated (vLLM)"),
    "allowed_token_ids": honored("the only tokens generated (vLLM)"),
    "prompt_logprobs": honored("log probabilities of the prompt's tokens (vLLM)"),
    "return_token_ids": honored("the answer's and prompt's token ids in the body (vLLM)"),
    "return_tokens_as_token_ids": honored("logprobs name tokens as `token_id:N` (vLLM)"),
    "logprob_token_ids": refused(MIXED_LOGPROBS),
    "return_token_offsets": no_effect(RENDER_ONLY),
    "truncate_prompt_tokens": honored("keep only the prompt's last (or first) N tokens (vLLM)"),
    "truncation_side": honored("which side `truncate_prompt_tokens` cuts (vLLM)"),
    "structured_outputs": honored("vLLM's constraints: json, regex, choice, grammar (xgrammar)"),
    "use_beam_search": honored("beam search, `n` beams (vLLM)"),
    "length_penalty": honored("beam search's length penalty (vLLM)"),
    "add_special_tokens": honored("add the tokenizer's special tokens to the prompt (vLLM)"),
    "priority": no_effect(PRIORITY, left_out=True),
    "request_id": refused(ID_BY_BATCH),
    "cache_salt": honored("a part of the prefix cache of its own, within its key's: the engine gets a hash of the "
                          "key's scope and this value (every request is salted by its key's scope anyway)"),
    "kv_transfer_params": no_effect(NO_TRANSFER, left_out=True),
    "ec_transfer_params": no_effect(NO_TRANSFER, left_out=True),
    "vllm_xargs": refused(NO_PLUGINS),
    "watermarking": no_effect("`false` only: no watermarking is configured, so there is none to opt out of",
                              _true("no watermarking is configured"), "for `true`"),
    "repetition_detection": honored("ends an answer early once an N-gram repeats `min_count` times (vLLM)"),
    "thinking_token_budget": refused("it needs vLLM's --reasoning-config, which the registry does not set"),
    "session_id": no_effect(NO_SESSION),
    "stream_interval": no_effect("the chunk size of a stream, and a batch line never streams; vLLM takes it"),
    "mm_payload": no_effect(RENDER_ONLY),
    "return_mm_kwargs": no_effect(RENDER_ONLY),
    "routed_experts_prompt_start": no_effect("it trims routed-expert data, which the engine here does not return; "
                                             "vLLM takes it"),
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
    "tool_choice": honored("`none`, `auto`, `required` or a named function", _tool_choice,
                           "for anything but `none` on a model without a tool-call parser, and for `required` or a "
                           "named function where the parser cannot make the call follow the tool's parameters"),
    "parallel_tool_calls": honored("`false`: at most one tool call"),
    # OpenAI refuses these on a model that does not reason; vLLM takes them on any model, and its answer is returned.
    "reasoning_effort": honored("passed to the chat template (`none` turns thinking off); a template that reads "
                                "neither, as a model without a reasoning parser's usually, is unchanged by it (vLLM)"),
    "include_reasoning": honored("`false` leaves the reasoning out of the answer; a model without a reasoning parser "
                                 "has none to leave out (vLLM)"),
    "enable_thinking": honored("a switch of the chat template (Qwen3), as `chat_template_kwargs.enable_thinking`"),
    "chat_template_kwargs": honored("variables for the model's chat template (vLLM)", _own_template,
                                    "with a `chat_template` or `tokenize` key (a template of the client's own)"),
    "add_generation_prompt": honored("`false` leaves out the assistant turn's opening (vLLM)"),
    "continue_final_message": honored("continue the last assistant message instead of starting one (vLLM)"),
    "echo": honored("the last assistant message's text before the answer (vLLM)"),
    "documents": honored("documents for chat templates that read them (retrieval templates; vLLM)"),
    "return_prompt_text": honored("the prompt's text, as the template made it, in the body (vLLM)"),
    "modalities": no_effect("`[\"text\"]` only: text is what is generated; vLLM ignores it", _text_only,
                            "for anything else"),
    "store": no_effect(STORED),
    "metadata": no_effect(METADATA_CHAT),
    "service_tier": no_effect(TIER, left_out=True),
    "chat_template": refused("a request may not replace the model's chat template (vLLM refuses it too)"),
    "mm_processor_kwargs": refused(NO_MM_KWARGS),
    "media_io_kwargs": refused(NO_MM_KWARGS),
    "audio": refused("no audio output: the registry's models answer in text"),
    "prediction": no_effect("a predicted output only makes OpenAI's answer faster, never different; vLLM ignores it"),
    "verbosity": no_effect("a setting of OpenAI's GPT-5 models; the models here have no such control, and vLLM "
                           "ignores it"),
    "web_search_options": refused("no web search runs here"),
    "functions": refused("deprecated by OpenAI: use `tools`"),
    "function_call": refused("deprecated by OpenAI: use `tool_choice`"),
    "moderation": refused("no moderation runs here"),
    "prompt_cache_key": no_effect(CACHE_KEY),
    "prompt_cache_options": no_effect(CACHE_OPTIONS),
    "prompt_cache_retention": no_effect(CACHE_OPTIONS),
    "safety_identifier": no_effect(IDENTIFIER),
}

_COMPLETIONS_ONLY = {
    "prompt": honored("text, texts, token ids or lists of token ids"),
    "max_tokens": honored("the most tokens to generate (16 when not set, as at OpenAI)"),
    "logprobs": honored("log probabilities of the answer's tokens, with the N most likely (0 to 5)"),
    "echo": honored("the prompt before the answer"),
    "response_format": honored("`json_object` or `json_schema` (vLLM), enforced by xgrammar"),
    "best_of": no_effect("up to `n` only: the best `n` of `n` are all of them; vLLM ignores it", _best_of,
                         "above `n`"),
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
    "padding": honored("`max_length` pads the prompt to the model's length, as models trained without an attention "
                       "mask need (vLLM)"),
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
    "include": honored("`message.output_text.logprobs`: the answer's logprobs (with `top_logprobs`); "
                       "`reasoning.encrypted_content` as vLLM returns it (nothing from a model without a reasoning "
                       "parser); the other values name outputs of built-in tools or input images, which no answer "
                       "here has (the web search's are left out before the engine: vLLM does not take them)",
                       to_engine=_includes_vllm_takes),
    "metadata": honored("echoed in the `response` object"),
    "user": SAMPLING["user"],
    "text": honored("`format`: `text`, `json_object` or `json_schema` (strict), enforced by xgrammar"),
    "tools": honored("function tools the model may call", _tool_calls, "on a model without a tool-call parser "
                                                                       "(unless `tool_choice` is `none`)"),
    "tool_choice": _CHAT_ONLY["tool_choice"],
    "parallel_tool_calls": _CHAT_ONLY["parallel_tool_calls"],
    "truncation": honored("`auto` cuts a prompt too long for the context from the start instead of failing"),
    "reasoning": honored("the reasoning `effort`, passed to the chat template as chat's `reasoning_effort` is (vLLM)"),
    "include_reasoning": _CHAT_ONLY["include_reasoning"],
    "service_tier": _CHAT_ONLY["service_tier"],
    "store": _CHAT_ONLY["store"],
    "stream": SAMPLING["stream"],
    "stream_options": SAMPLING["stream_options"],
    "previous_response_id": refused("a batch request cannot continue a stored response: give the whole input"),
    "conversation": refused("a batch request cannot continue a stored conversation: give the whole input"),
    "background": no_effect("a batch line already runs in the background, and its answer is the finished response; "
                            "left out (vLLM would answer with a queued one)", left_out=True),
    "background_options": no_effect("a batch line already runs in the background, in the batch's window; vLLM "
                                    "ignores it"),
    "prompt": refused("stored prompt templates are OpenAI's (vLLM refuses them)"),
    "max_tool_calls": no_effect("it bounds calls of built-in tools, and none runs here; vLLM echoes it"),
    "context_management": refused("OpenAI compacts the context past a threshold, which nothing does here"),
    "access_programs": no_effect("an OpenAI account's access programs; the models here have none, and vLLM ignores "
                                 "it"),
    "image": refused("OpenAI's request-level image options (context compression), which nothing applies here"),
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
    "documents": honored(f"the texts scored: a string or up to {c.MAX_SCORE_TEXTS:,} strings"),
    "user": SAMPLING["user"],
    "truncate_prompt_tokens": honored("keep only each text's last (or first) N tokens (vLLM)"),
    "truncation_side": SAMPLING["truncation_side"],
    "max_tokens_per_query": honored("cut each query to N tokens (vLLM; 0: not cut)"),
    "max_tokens_per_doc": honored("cut each document to N tokens (vLLM; 0: not cut)"),
    "use_activation": no_effect("the score of the registry's scoring models (embedding models) is a cosine "
                                "similarity, which the activation does not change; vLLM takes it"),
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
    "queries": honored(f"the text(s) each document is scored against: one, or one per document (up to "
                       f"{c.MAX_SCORE_TEXTS:,})"),
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


def _anthropic_tool_calls(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    """Anthropic's `tools` and `tool_choice` as chat's are: a tool may be called (any choice but `none`) only where the
    model has a tool-call parser, and forced (`any`, or a named `tool`) only where its parser makes the call follow
    the tool's parameters."""
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "none" or serves is None:
        return None
    if not serves.tool_calls:
        return NO_TOOL_PARSER
    return serves.forced_tools_refused if kind in ("any", "tool") else None


def _thinking(value: Any, body: dict[str, Any], serves: Serves | None) -> str | None:
    """vLLM's Messages layer turns a thinking budget into `thinking_token_budget`, which needs --reasoning-config."""
    if isinstance(value, dict) and value.get("type") == "enabled":
        return ("`enabled` with a `budget_tokens` needs vLLM's --reasoning-config, which the registry does not set: "
                "use `adaptive` (or `disabled`)")
    return None


_MESSAGES = {
    "model": SAMPLING["model"],
    "messages": honored("the conversation: `user` and `assistant` turns, blocks `text`, `tool_use`, `tool_result`, "
                        "`thinking`, and `image` (base64) where the model takes images; as vLLM's Messages layer "
                        "turns them into a chat request"),
    "max_tokens": honored("the most tokens to generate (required); `stop_reason: max_tokens` when reached"),
    "system": honored("the system prompt: a string or text blocks"),
    "stop_sequences": honored("stop strings; `stop_reason: stop_sequence` and `stop_sequence` name the one met"),
    "temperature": honored("sampling temperature (0 to 1); 0 is greedy"),
    "top_p": SAMPLING["top_p"],
    "top_k": honored("top-k sampling"),
    "tools": honored("client tools (`input_schema`) the model may call", _anthropic_tool_calls,
                     "on a model without a tool-call parser (unless `tool_choice` is `none`)"),
    "tool_choice": honored("`auto`, `any`, a named `tool` or `none`; `disable_parallel_tool_use`",
                           _anthropic_tool_calls, "for anything but `none` on a model without a tool-call parser, and "
                           "for `any` or a named `tool` where the parser cannot make the call follow the tool's "
                           "parameters"),
    "thinking": honored("`disabled` turns the chat template's thinking off; `adaptive` leaves it to the model (vLLM)",
                        _thinking, "for `enabled` (a token budget)"),
    "output_config": honored("`format` (`json_schema`, enforced by xgrammar) and `effort` (the chat template's "
                             "reasoning effort), as vLLM's Messages layer maps them"),
    "metadata": no_effect("Anthropic's `user_id` for its abuse monitoring, none of which runs here; vLLM ignores it"),
    "stream": SAMPLING["stream"],
    "service_tier": no_effect("a batch runs in the batch tier, whatever tier the request names; vLLM ignores it"),
    "inference_geo": no_effect("the request runs on this service's hardware, wherever that is; vLLM ignores it"),
    "speed": no_effect("the engine has one speed, and the answer is the same at any; vLLM ignores it"),
    "cache_control": no_effect("Anthropic's prompt cache marker; the engine keeps its own prefix cache, and vLLM "
                               "ignores it"),
    "workspace_id": no_effect("an Anthropic Workspace; a key here is the service's own, and vLLM ignores it"),
    "user_profile_id": no_effect("whom Anthropic attributes the request to; vLLM ignores it"),
    "container": refused("no code execution container runs here"),
    "diagnostics": refused("no prompt-cache diagnostics are made here, so the answer could not carry them"),
    "chat_template_kwargs": _CHAT_ONLY["chat_template_kwargs"],
    **{name: SAMPLING[name] for name in (
        "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "watermarking", "mm_payload",
        "return_mm_kwargs")},
}

FIELDS: dict[str, dict[str, Field]] = {
    c.CHAT: {**SAMPLING, **_CHAT_ONLY},
    c.COMPLETIONS: {**SAMPLING, **_COMPLETIONS_ONLY},
    c.EMBEDDINGS: _EMBEDDINGS,
    c.RESPONSES: _RESPONSES,
    c.SCORE: _SCORE,
    c.RERANK: _RERANK,
    c.MESSAGES: _MESSAGES,
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
    if not part.accepted:
        return part.note
    return part.refuse(kind, {}, serves) if part.refuse is not None else None


def refusal(url: str, name: str, body: dict[str, Any], serves: Serves | None) -> str | None:
    """Why `body[name]` is refused on `url` for a model that `serves` (None: not known), or None."""
    field = FIELDS[url].get(name)
    value = body[name]
    if field is None:
        return UNKNOWN.format(url=url)
    if not field.accepted:
        return field.note
    return field.refuse(value, body, serves) if field.refuse is not None else None


# The fields some value of which reaches vLLM otherwise than given, per endpoint.
_CHANGED = {url: {name: f.to_engine for name, f in table.items() if f.to_engine is not None}
            for url, table in FIELDS.items()}


def for_engine(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` (valid) as vLLM gets it: the accepted no-ops it would refuse left out, and `include` cut to what it takes.
    The answer is vLLM's either way."""
    changed = _CHANGED[url]
    if not changed.keys() & body.keys():
        return body
    out = {}
    for name, value in body.items():
        if value is not None and name in changed:
            value = changed[name](value)
            if value is LEFT_OUT:
                continue
        out[name] = value
    return out


def counts() -> dict[str, dict[str, int]]:
    """How many fields of each kind per endpoint."""
    return {url: {kind: sum(f.kind == kind for f in table.values()) for kind in (HONORED, NO_EFFECT, REFUSED)}
            for url, table in FIELDS.items()}
