"""Type and range checks of request bodies, per endpoint, after the public OpenAI API schema.

Validation calls `check_body` for every line, so a body the pipeline or an engine could not take
(a string temperature, a content part whose text is a number, a body nested too deep to store)
is an error at its line instead of a failed batch. Fields outside the schema are passed through
untouched, but only if they are nested at most `MAX_DEPTH` levels; that limit holds for every
endpoint (`check_depth`), /v1/responses included.

The schema is a set of msgspec structs: `msgspec.convert` checks a parsed body in C, several
times faster than the same checks in Python, which matters at 50,000 lines per file.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from . import contract as c

# Nesting levels of a body (the body itself is level 1). orjson, which stores bodies, stops at
# 254 levels; real bodies (tool schemas included) stay far below this.
MAX_DEPTH = 64
# Token ids as vLLM takes them (int32); ids past the vocabulary are refused by the engine, per request.
MAX_TOKEN_ID = 2**31 - 1


class BodyError(Exception):
    """A body field of the wrong type or out of range: `param` names it (`body.temperature`).

    Such a request is still stored and ends as its own 400 line; a body too deep to store
    (`storable` False) is stored as `cut` makes it.
    """

    def __init__(self, param: str, message: str, *, storable: bool = True):
        super().__init__(message)
        self.param = param
        self.storable = storable


def _range(low: float | None = None, high: float | None = None) -> Any:
    return msgspec.Meta(ge=low, le=high)


PositiveInt = Annotated[int, _range(1)]
Temperature = Annotated[float, _range(0, 2)]
Probability = Annotated[float, _range(0, 1)]
Penalty = Annotated[float, _range(-2, 2)]
Int64 = Annotated[int, _range(-(2**63), 2**63 - 1)]
TokenId = Annotated[int, _range(0, MAX_TOKEN_ID)]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
Object = dict[str, Any]


# Chat content parts: the types OpenAI's schema lists, told apart by `type`.
class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrlPart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: Object


class InputAudioPart(msgspec.Struct, tag="input_audio", tag_field="type"):
    input_audio: Object


class FilePart(msgspec.Struct, tag="file", tag_field="type"):
    file: Object


class RefusalPart(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


Part = TextPart | ImageUrlPart | InputAudioPart | FilePart | RefusalPart


class Message(msgspec.Struct):
    role: Role
    # null is an assistant turn that carries tool calls instead; the engine reads it as "".
    content: str | list[Part] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Object] | None = None


class _Sampling(msgspec.Struct):
    """OpenAI's sampling fields and vLLM's extras, shared by chat and completions."""

    model: str | None = None  # present and non-empty: validate checks it first
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
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


class ChatBody(_Sampling):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = []
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _range(0, 20)] | None = None
    enable_thinking: bool | None = None
    chat_template_kwargs: Object | None = None
    response_format: Object | None = None
    tools: list[Object] | None = None
    tool_choice: str | Object | None = None
    parallel_tool_calls: bool | None = None
    metadata: Object | None = None
    store: bool | None = None


class CompletionBody(_Sampling):
    # `prompt` is checked by `_prompts`: msgspec unions take one array type only.
    logprobs: Annotated[int, _range(0, 5)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, _range(1, 20)] | None = None
    suffix: str | None = None


class EmbeddingBody(msgspec.Struct):
    model: str | None = None  # present and non-empty: validate checks it first
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveInt | None = None
    user: str | None = None


SCHEMAS: dict[str, type[msgspec.Struct]] = {
    c.CHAT: ChatBody, c.COMPLETIONS: CompletionBody, c.EMBEDDINGS: EmbeddingBody,
}
_PROMPT = {c.COMPLETIONS: "prompt", c.EMBEDDINGS: "input"}
# The body fields each endpoint knows (what docs/formats.md lists).
FIELDS = {url: frozenset(schema.__struct_fields__) | {_PROMPT.get(url, "messages")} for url, schema in SCHEMAS.items()}
# Schema fields that hold free-form JSON, whose depth msgspec does not bound.
_FREE_FORM = frozenset({"logit_bias", "chat_template_kwargs", "response_format", "tools", "tool_choice", "metadata"})
# msgspec's messages end in " - at `$.path`"; a missing field is named in the message.
_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"missing required field `([^`]+)`")
# msgspec quotes a wrong value whole ("Invalid enum value 'zzz…'"): the message quotes it cut instead.
_ECHO = re.compile(r"^(?P<head>Invalid (?:enum )?value )'(?P<value>.*)'$", re.S)
# msgspec names Python types; the API's users know JSON's.
_JSON_TYPES = {"float": "number", "int": "integer", "str": "string", "bool": "boolean"}
_JSON_TYPE = re.compile(r"(?<=[`| ])(float|int|str|bool)(?=[`| ])")


def check_body(url: str, body: dict[str, Any]) -> None:
    """Raise BodyError for the first field of `body` of the wrong type, out of range, or nested too deep.

    `body.model` and the presence of the prompt field are the caller's to check (validate does).
    """
    if _plain(url, body):
        return
    try:
        msgspec.convert(body, SCHEMAS[url])
        prompt = _PROMPT.get(url)
        if prompt is not None:
            _prompts(body[prompt], f"body.{prompt}")
    except msgspec.ValidationError as exc:
        wrong: BodyError | None = _body_error(str(exc))
    except BodyError as exc:
        wrong = exc
    else:
        wrong = None
    fields = FIELDS[url]
    # Depth first: a body too deep to store must fail the file even when a field is also mistyped.
    if wrong is not None or not fields.issuperset(body) or not _FREE_FORM.isdisjoint(body):
        for key, value in body.items():
            if (wrong is not None or key not in fields or key in _FREE_FORM) and type(value) in (dict, list):
                _bounded(value, f"body.{key}", 2)
    if url == c.CHAT and wrong is None:
        for i, m in enumerate(body["messages"]):
            # Content parts and fields outside the schema may nest: bound the message (level 3).
            if len(m) > 2 or type(m.get("content")) is list:
                _bounded(m, f"body.messages[{i}]", 3)
    if wrong is not None:
        raise wrong


# The fast path: most bodies hold text messages or prompts and a few numbers in range. Those are
# recognized here with a few dict lookups; anything else goes through the schema above. The
# ranges are the schema's (tests/core/test_bodies.py checks that this never accepts more).
_NUM = (int, float)
_PLAIN_SCALARS: dict[str, tuple[tuple[type, ...], float, float]] = {
    "max_tokens": ((int,), 1, 2**63),
    "max_completion_tokens": ((int,), 1, 2**63),
    "temperature": (_NUM, 0, 2),
    "top_p": (_NUM, 0, 1),
    "n": ((int,), 1, 128),
    "seed": ((int,), -(2**63), 2**63 - 1),
    "presence_penalty": (_NUM, -2, 2),
    "frequency_penalty": (_NUM, -2, 2),
    "top_k": ((int,), -1, 2**63),
    "min_p": (_NUM, 0, 1),
    "min_tokens": ((int,), 0, 2**63),
}
# Booleans on every endpoint that knows them (`logprobs` is not: an integer for completions).
_PLAIN_SWITCHES = frozenset({"ignore_eos", "stream", "enable_thinking", "echo"})
_PLAIN_TEXT = {c.CHAT: "messages", c.COMPLETIONS: "prompt", c.EMBEDDINGS: "input"}
_ROLES = frozenset(Role.__args__)  # type: ignore[attr-defined]


def _plain(url: str, body: dict[str, Any]) -> bool:
    """True for a body of text and in-range numbers only; False means "ask the schema", not "invalid"."""
    text = _PLAIN_TEXT[url]
    for key, value in body.items():
        if key == "model" or key == text:
            continue
        spec = _PLAIN_SCALARS.get(key)
        if spec is None:
            if type(value) is bool and key in _PLAIN_SWITCHES:
                continue
            if key == "stop" and (type(value) is str or type(value) is list and all(type(s) is str for s in value)):
                continue
            return False
        if type(value) not in spec[0] or not spec[1] <= value <= spec[2]:
            return False
    value = body[text]
    if url != c.CHAT:
        return type(value) is str
    for m in value:
        if type(m) is not dict or len(m) != 2 or type(m.get("content")) is not str:
            return False
        role = m.get("role")
        if type(role) is not str or role not in _ROLES:
            return False
    return True


def _body_error(text: str) -> BodyError:
    m = _AT.match(text)
    assert m is not None  # the pattern matches any text
    message, path = m["message"], m["path"] or ""
    missing = _MISSING.search(message)
    if missing:
        path += f".{missing[1]}"
    param = "body" + path
    if echo := _ECHO.match(message):
        message = echo["head"] + c.quoted(echo["value"])
    message = message.replace(" | null", "")  # every field may be null; saying so on each error is noise
    message = _JSON_TYPE.sub(lambda m: _JSON_TYPES[m[0]], message)
    return BodyError(param, f"Field {param!r}: {message[0].lower()}{message[1:]}.")


def check_depth(body: dict[str, Any]) -> None:
    """Raise BodyError (not storable) for the first field of `body` nested deeper than MAX_DEPTH."""
    for key, value in body.items():
        if type(value) is dict or type(value) is list:
            _bounded(value, f"body.{key}", 2)


def cut(value: Any, level: int = 1) -> Any:
    """`value` (a body: level 1) with every container at level MAX_DEPTH + 1 emptied. A body too deep to store
    is stored so: orjson can write it, and it is still too deep, so it ends as the same 400 line at run time."""
    if level > MAX_DEPTH:
        return type(value)()
    if type(value) is dict:
        return {k: cut(v, level + 1) if type(v) is dict or type(v) is list else v for k, v in value.items()}
    return [cut(v, level + 1) if type(v) is dict or type(v) is list else v for v in value]


def _bounded(v: Any, param: str, level: int) -> None:
    """Reject a value nested deeper than MAX_DEPTH (`level` is the value's own level in the body)."""
    if level > MAX_DEPTH:
        raise BodyError(param, f"Field {param!r} is nested deeper than {MAX_DEPTH} levels.", storable=False)
    for x in v.values() if type(v) is dict else v:
        if type(x) is dict or type(x) is list:
            _bounded(x, param, level + 1)


def _tokens(v: list[Any]) -> bool:
    """True if `v` is a non-empty list of token ids."""
    return bool(v) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in v)


def _prompts(v: Any, param: str) -> None:
    """`prompt` / `input`: a string, strings, token ids, or lists of token ids (never an empty list)."""
    if type(v) is str:
        return
    if type(v) is list and v:
        first = v[0]
        if type(first) is int and _tokens(v):
            return
        if type(first) is str and all(type(p) is str for p in v):
            return
        if type(first) is list and all(type(p) is list and _tokens(p) for p in v):
            return
    raise BodyError(param, f"Field {param!r} must be a string, or a non-empty array of strings, of token ids "
                           f"(integers 0 to {MAX_TOKEN_ID}) or of non-empty arrays of token ids.")
