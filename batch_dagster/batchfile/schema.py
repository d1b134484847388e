"""The types and ranges of the request body fields the field matrix honors (batchfile/fields.py), per endpoint.

msgspec structs after the public OpenAI API schema and vLLM's extras: `msgspec.convert` checks a parsed body in C,
several times faster than the same checks in Python, which matters at 50,000 lines per file. bodies.check_body
runs them; docs/formats.md's field tables name each field's type from them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from . import contract as c

# What vLLM takes as a cache_salt (vllm/entrypoints/generate/base/protocol.py validate_cache_salt): 1 to 128
# characters, none of them '@', '/', '\' or NUL. A request's own salt is salted further per owner (features/scope.py).
CLIENT_SALT = r"^[^@/\\\x00]{1,128}\Z"

# Token ids as vLLM takes them (int32); ids past the vocabulary are refused by the engine, per request.
MAX_TOKEN_ID = 2**31 - 1


def _range(low: float | None = None, high: float | None = None) -> Any:
    return msgspec.Meta(ge=low, le=high)


PositiveInt = Annotated[int, _range(1)]
Temperature = Annotated[float, _range(0, 2)]
Probability = Annotated[float, _range(0, 1)]
Penalty = Annotated[float, _range(-2, 2)]
Int64 = Annotated[int, _range(-(2**63), 2**63 - 1)]
TokenId = Annotated[int, _range(0, MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
Object = dict[str, Any]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
CacheSalt = Annotated[str, msgspec.Meta(pattern=CLIENT_SALT)]


# Chat content parts: the types OpenAI's schema lists, told apart by `type` (which of them a model takes: fields.py).
class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class InputAudioPart(msgspec.Struct, tag="input_audio", tag_field="type"):
    input_audio: Object


class FilePart(msgspec.Struct, tag="file", tag_field="type"):
    file: Object


class RefusalPart(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


Part = TextPart | ImageUrlPart | InputAudioPart | FilePart | RefusalPart


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct):
    role: Role
    # null is an assistant turn that carries tool calls instead.
    content: str | list[Part] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


# Structured outputs: OpenAI's response formats (chat, and vLLM's completions) and vLLM's own constraints.
class JsonSchema(msgspec.Struct):
    name: Name
    schema: Object | None = None
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type"):
    json_schema: JsonSchema


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class RepetitionDetection(msgspec.Struct, forbid_unknown_fields=True):
    max_pattern_size: Annotated[int, _range(0)] = 0
    min_pattern_size: Annotated[int, _range(0)] = 0
    min_count: Annotated[int, _range(0)] = 0


class Prediction(msgspec.Struct):
    content: str | list[TextPart]
    type: Literal["content"] = "content"


# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]
Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
Padding = Literal["max_length", "do_not_pad"]
CacheRetention = Literal["in_memory", "24h"]


class _Unused(msgspec.Struct):
    """The fields accepted with no effect on the models here (fields.py says why), on every endpoint of vLLM's."""

    priority: Int64 | None = None


class _UnusedGenerating(_Unused):
    """The same on the generating endpoints."""

    session_id: str | None = None
    kv_transfer_params: Object | None = None
    ec_transfer_params: Object | None = None
    watermarking: bool | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    json: Object | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


# Tools.
class Function(msgspec.Struct):
    name: Name
    description: str | None = None
    parameters: Object | None = None
    strict: bool | None = None


class Tool(msgspec.Struct):
    function: Function
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


class _Sampling(_UnusedGenerating):
    """OpenAI's sampling fields and vLLM's extras, shared by chat and completions."""

    model: str | None = None  # present and non-empty: validate checks it first
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: Annotated[int, _range(1, 128)] | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, _range(-100, 100)]] | None = None
    user: str | None = None
    stream: bool | None = None
    top_k: Annotated[int, _range(-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    min_tokens: Annotated[int, _range(0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: TokenIds | None = None
    prompt_logprobs: Annotated[int, _range(-1, 20)] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: Annotated[int, _range(-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    add_special_tokens: bool | None = None
    echo: bool | None = None
    repetition_detection: RepetitionDetection | None = None
    spaces_between_special_tokens: bool | None = None
    return_token_offsets: bool | None = None
    stream_interval: Annotated[int, _range(1)] | None = None
    routed_experts_prompt_start: Annotated[int, _range(0)] | None = None
    cache_salt: CacheSalt | None = None


class ChatBody(_Sampling):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = []
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _range(0, 20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    include_reasoning: bool | None = None
    enable_thinking: bool | None = None
    chat_template_kwargs: Object | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, str]] | None = None
    return_prompt_text: bool | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    metadata: Metadata | None = None
    prediction: Prediction | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Object | None = None
    prompt_cache_retention: CacheRetention | None = None
    safety_identifier: str | None = None


class CompletionBody(_Sampling):
    # `prompt` is checked by `_prompts`: msgspec unions take one array type only.
    logprobs: Annotated[int, _range(0, 5)] | None = None
    best_of: Annotated[int, _range(1)] | None = None


class EmbeddingBody(_Unused):
    model: str | None = None  # present and non-empty: validate checks it first
    encoding_format: Literal["float", "base64"] | None = None
    user: str | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] | None = None
    endianness: Literal["native", "big", "little"] | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: Annotated[int, _range(-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None
    padding: Padding | None = None
    cache_salt: CacheSalt | None = None


class ResponsesJsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type"):
    name: Name
    schema: Object | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | JsonObjectFormat | ResponsesJsonSchemaFormat | None = None


class ResponsesTool(msgspec.Struct, tag="function", tag_field="type"):
    name: Name
    description: str | None = None
    parameters: Object | None = None
    strict: bool | None = None


class ResponsesNamedTool(msgspec.Struct):
    name: str
    type: Literal["function"] = "function"


class Reasoning(msgspec.Struct):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesBody(_UnusedGenerating):
    # `input` is checked by `_responses_input`: its items are told apart by an optional `type`.
    model: str | None = None  # present and non-empty: validate checks it first
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_logprobs: Annotated[int, _range(0, 20)] | None = None
    include: list[Includable] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    text: TextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    include_reasoning: bool | None = None
    service_tier: str | None = None
    store: bool | None = None
    stream: bool | None = None
    chat_template_kwargs: Object | None = None
    enable_response_messages: bool | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    top_k: Annotated[int, _range(-1)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, _range(-100, 100)]] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    structured_outputs: StructuredOutputs | None = None
    background: bool | None = None
    background_options: Object | None = None
    max_tool_calls: Annotated[int, _range(0)] | None = None
    access_programs: Object | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Object | None = None
    prompt_cache_retention: CacheRetention | None = None
    safety_identifier: str | None = None
    cache_salt: CacheSalt | None = None


Texts = str | Annotated[list[str], msgspec.Meta(min_length=1, max_length=c.MAX_SCORE_TEXTS)]


class _ScoringBody(_Unused):
    model: str | None = None  # present and non-empty: validate checks it first
    documents: Texts = ""
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, _range(-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    max_tokens_per_query: Annotated[int, _range(0)] | None = None
    max_tokens_per_doc: Annotated[int, _range(0)] | None = None
    padding: Padding | None = None
    use_activation: bool | None = None
    cache_salt: CacheSalt | None = None


class ScoreBody(_ScoringBody):
    queries: Texts = ""


class RerankBody(_ScoringBody):
    query: str = ""
    top_n: Annotated[int, _range(0)] | None = None


# Anthropic's Messages API (/v1/messages): the fields vLLM's layer reads (vllm/entrypoints/anthropic/protocol.py).
class AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Object]


class AnthropicTool(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    input_schema: Object
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: Object | None = None


class AnthropicToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(msgspec.Struct):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, _range(1024)] | None = None
    display: Literal["summarized", "omitted", "updates"] | None = None


class AnthropicJsonFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: Object


class AnthropicOutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicJsonFormat | None = None


class MessagesBody(msgspec.Struct, kw_only=True):
    # `messages` and `system` blocks are checked by `_anthropic_messages` against the model (which blocks it takes).
    max_tokens: PositiveInt
    model: str | None = None  # present and non-empty: validate checks it first
    messages: list[AnthropicMessage] = []
    system: str | list[Object] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, _range(0, 1)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, _range(-1)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    metadata: Object | None = None
    stream: bool | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    cache_control: Object | None = None
    workspace_id: str | None = None
    user_profile_id: str | None = None
    chat_template_kwargs: Object | None = None
    cache_salt: CacheSalt | None = None
    # vLLM's no-ops (fields.py): the ones its Messages request model has.
    kv_transfer_params: Object | None = None
    ec_transfer_params: Object | None = None
    watermarking: bool | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None


SCHEMAS: dict[str, type[msgspec.Struct]] = {
    c.CHAT: ChatBody, c.COMPLETIONS: CompletionBody, c.EMBEDDINGS: EmbeddingBody, c.RESPONSES: ResponsesBody,
    c.SCORE: ScoreBody, c.RERANK: RerankBody, c.MESSAGES: MessagesBody,
}
# Each endpoint's prompt field (score and rerank: what they score; validation checks their query is there too).
PROMPT = {c.CHAT: "messages", c.COMPLETIONS: "prompt", c.EMBEDDINGS: "input", c.RESPONSES: "input",
          c.SCORE: "documents", c.RERANK: "documents", c.MESSAGES: "messages"}
# The body fields each endpoint types (what the field matrix honors).
TYPED = {url: frozenset(schema.__struct_fields__) | {PROMPT[url]} for url, schema in SCHEMAS.items()}
