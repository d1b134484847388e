"""The checks of a request body, per endpoint: refused fields, types and ranges, content parts, nesting.

Validation calls `check_body` for every line, so a body the pipeline or an engine could not take (a string
temperature, a content part whose text is a number, a field the field matrix refuses, a body nested too deep to
store) is an error at its line instead of a failed batch or a silently changed request. What each field does, and
why a refused one is refused, is batchfile/fields.py; the types and ranges of the fields it honors are
batchfile/schema.py. A body may be nested at most `MAX_DEPTH` levels on every endpoint.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from . import contract as c
from . import image_sources
from .fields import SERVED_PARTS, Serves, part_refusal, refusal
from .schema import MAX_TOKEN_ID, PROMPT, SCHEMAS, TYPED, Role

# Nesting levels of a body (the body itself is level 1). orjson, which stores bodies, stops at
# 254 levels; real bodies (tool schemas included) stay far below this.
MAX_DEPTH = 64


class BodyError(Exception):
    """A body field of the wrong type or out of range: `param` names it (`body.temperature`).

    Such a request is still stored and ends as its own 400 line; a body too deep to store
    (`storable` False) is stored as `cut` makes it.
    """

    def __init__(self, param: str, message: str, *, storable: bool = True):
        super().__init__(message)
        self.param = param
        self.storable = storable


# msgspec's messages end in " - at `$.path`"; a missing field is named in the message.
_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"missing required field `([^`]+)`")
# msgspec quotes a wrong value whole ("Invalid enum value 'zzz…'"): the message quotes it cut instead.
_ECHO = re.compile(r"^(?P<head>Invalid (?:enum )?value )'(?P<value>.*)'$", re.S)
# msgspec names Python types; the API's users know JSON's.
_JSON_TYPES = {"float": "number", "int": "integer", "str": "string", "bool": "boolean"}
_JSON_TYPE = re.compile(r"(?<=[`| ])(float|int|str|bool)(?=[`| ])")


def check_body(url: str, body: dict[str, Any], serves: Serves | None = None) -> None:
    """Raise BodyError for the first field of `body` the field matrix refuses (for a model that `serves`; None: not
    known), of the wrong type or out of range, or nested too deep.

    `body.model` and the presence of the prompt field are the caller's to check (validate does).
    """
    if _plain(url, body):
        return
    prompt = PROMPT[url]
    try:
        for key, value in body.items():
            if value is not None and (why := refusal(url, key, body, serves)) is not None:
                raise BodyError(f"body.{key}", f"Field 'body.{key}' is refused: {why}.")
        msgspec.convert(body, SCHEMAS[url])
        _PROMPT_CHECKS[url](body[prompt], f"body.{prompt}", serves)
    except msgspec.ValidationError as exc:
        wrong: BodyError | None = _body_error(str(exc))
    except BodyError as exc:
        wrong = exc
    else:
        wrong = None
    # Depth first: a body too deep to store must fail the file even when a field is also wrong.
    for key, value in body.items():
        if key == prompt and type(value) is list:
            for i, item in enumerate(value):  # a message or input item (level 3) names itself
                if type(item) is dict or type(item) is list:
                    _bounded(item, f"body.{key}[{i}]", 3)
        elif type(value) is dict or type(value) is list:
            _bounded(value, f"body.{key}", 2)
    if wrong is not None:
        raise wrong


def _parts_refused(parts: list[Any], param: str, serves: Serves | None) -> None:
    """Refuse a content part the model does not take (an image on a text model, audio, a file), by its place."""
    images = 0
    for j, part in enumerate(parts):
        kind = part.get("type") if type(part) is dict else None
        if kind not in SERVED_PARTS:
            continue  # not a part at all: its type error is the schema's
        if (why := part_refusal(kind, serves)) is not None:
            raise BodyError(f"{param}[{j}]", f"Content part '{param}[{j}]' ({kind}) is refused: {why}.")
        if kind not in ("image_url", "input_image"):
            continue
        images += 1
        if serves is not None and images > serves.images:
            raise BodyError(f"{param}[{j}]", f"Content part '{param}[{j}]' is refused: this model takes at most "
                                             f"{serves.images} image(s) per request.")
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url  # chat's {"url": ...}, responses' plain URL
        why = image_sources.refusal(url, serves.image_sources if serves is not None else None)
        if why is not None:
            raise BodyError(f"{param}[{j}]", f"Content part '{param}[{j}]' ({kind}) is refused: {why}.")


def _messages(messages: Any, param: str, serves: Serves | None) -> None:
    """Chat messages: the schema types them; here their content parts are checked against the model."""
    if type(messages) is not list:
        return
    for i, m in enumerate(messages):
        if type(m) is dict and type(m.get("content")) is list:
            _parts_refused(m["content"], f"{param}[{i}].content", serves)


_ITEM_ROLES = ("user", "assistant", "system", "developer")
_ITEM_FIELDS = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _responses_input(value: Any, param: str, serves: Serves | None) -> None:
    """/v1/responses `input`: a string, or message, `function_call` and `function_call_output` items."""
    if type(value) is str:
        if not value:
            raise BodyError(param, f"Field {param!r} must not be empty.")
        return
    if type(value) is not list or not value:
        raise BodyError(param, f"Field {param!r} must be a string or a non-empty array of input items.")
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if type(item) is not dict:
            raise BodyError(where, f"Field {where!r} must be an object (a message, or a function call or its output).")
        kind = item.get("type", "message")
        if kind in _ITEM_FIELDS:
            for name in _ITEM_FIELDS[kind]:
                if type(item.get(name)) is not str:
                    raise BodyError(f"{where}.{name}", f"Field '{where}.{name}' must be a string.")
            continue
        if kind != "message":
            raise BodyError(f"{where}.type", f"Field '{where}.type' is {c.quoted(kind)}: only 'message', "
                                             "'function_call' and 'function_call_output' items are served.")
        if item.get("role") not in _ITEM_ROLES:
            raise BodyError(f"{where}.role", f"Field '{where}.role' must be one of {', '.join(_ITEM_ROLES)}.")
        content = item.get("content")
        if type(content) is str:
            continue
        if type(content) is not list:
            raise BodyError(f"{where}.content", f"Field '{where}.content' must be a string or an array of parts.")
        _parts_refused(content, f"{where}.content", serves)
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if type(part) is dict else None
            if kind in _TEXT_PARTS:
                if type(part.get(_TEXT_PARTS[kind])) is not str:
                    raise BodyError(at, f"Field {at!r} must hold its text as a string.")
            elif kind == "input_image":
                if type(part.get("image_url")) is not str:
                    raise BodyError(f"{at}.image_url", f"Field '{at}.image_url' must be a string (a URL).")
            else:
                raise BodyError(at, f"Field {at!r} must be a content part ('input_text', 'output_text' or "
                                    "'input_image').")


# The content blocks of an Anthropic message that vLLM's Messages layer turns into a chat request.
_ANTHROPIC_BLOCKS = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})


def _anthropic_messages(messages: Any, param: str, serves: Serves | None) -> None:
    """/v1/messages `messages` (the schema types the turns): each content block one vLLM's Messages layer takes, and
    an image only where the model takes images, given as base64 (by URL, vLLM would fetch it itself, past the checks
    of where the service's requests may go)."""
    if type(messages) is not list or not messages:
        raise BodyError(param, f"Field {param!r} must be a non-empty array of messages.")
    images = 0
    for i, m in enumerate(messages):
        content = m.get("content") if type(m) is dict else None
        for j, block in enumerate(content if type(content) is list else ()):
            at = f"{param}[{i}].content[{j}]"
            kind = block.get("type") if type(block) is dict else None
            if kind not in _ANTHROPIC_BLOCKS:
                raise BodyError(at, f"Content block {at!r} ({c.quoted(kind)}) is refused: vLLM's Messages layer takes "
                                    f"{', '.join(sorted(_ANTHROPIC_BLOCKS))} blocks only.")
            if kind == "text" and type(block.get("text")) is not str:
                raise BodyError(f"{at}.text", f"Field '{at}.text' must be a string.")
            if kind != "image":
                continue
            images += 1
            source = block.get("source")
            if (why := part_refusal("image_url", serves)) is not None:
                raise BodyError(at, f"Content block {at!r} (image) is refused: {why}.")
            if serves is not None and images > serves.images:
                raise BodyError(at, f"Content block {at!r} is refused: this model takes at most {serves.images} "
                                    "image(s) per request.")
            if type(source) is not dict or source.get("type") != "base64" or type(source.get("data")) is not str:
                raise BodyError(f"{at}.source", f"Field '{at}.source' is refused: give the image as a `base64` "
                                                "source (an image by URL would be fetched by the engine, past the "
                                                "service's checks of where it may go).")


def _prompt(value: Any, param: str, serves: Serves | None) -> None:
    _prompts(value, param)


def _typed(value: Any, param: str, serves: Serves | None) -> None:
    """Score and rerank texts: the schema types them all."""


_PROMPT_CHECKS = {c.CHAT: _messages, c.COMPLETIONS: _prompt, c.EMBEDDINGS: _prompt, c.RESPONSES: _responses_input,
                  c.SCORE: _typed, c.RERANK: _typed, c.MESSAGES: _anthropic_messages}


# The fast path: most bodies hold text messages or prompts and a few numbers in range. Those are
# recognized here with a few dict lookups; anything else goes through the schema above. The
# ranges are the schema's, the fields those the matrix honors for every value and model (tests/core/test_bodies.py
# checks that this never accepts more).
_NUM = (int, float)
_PLAIN_SCALARS: dict[str, tuple[tuple[type, ...], float, float]] = {
    "max_tokens": ((int,), 1, 2**63),
    "max_completion_tokens": ((int,), 1, 2**63),
    "max_output_tokens": ((int,), 1, 2**63),
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
# Booleans (`logprobs` is not: an integer for completions). `stream` is plain only when false.
_PLAIN_SWITCHES = frozenset({"ignore_eos", "enable_thinking", "echo", "stream"})
_PLAIN_STRINGS = frozenset({"user", "instructions"})
_PLAIN_KEYS = {url: frozenset((*_PLAIN_SCALARS, *_PLAIN_SWITCHES, *_PLAIN_STRINGS, "stop")) & TYPED[url]
               for url in SCHEMAS}
_ROLES = frozenset(Role.__args__)  # type: ignore[attr-defined]


def _plain(url: str, body: dict[str, Any]) -> bool:
    """True for a body of text and in-range numbers only; False means "ask the schema", not "invalid"."""
    if url in (c.SCORE, c.RERANK, c.MESSAGES):
        return False
    text = PROMPT[url]
    keys = _PLAIN_KEYS[url]
    for key, value in body.items():
        if key == "model" or key == text:
            continue
        if key not in keys:
            return False
        spec = _PLAIN_SCALARS.get(key)
        if spec is None:
            if type(value) is bool and key in _PLAIN_SWITCHES and not (key == "stream" and value):
                continue
            if key in _PLAIN_STRINGS and type(value) is str:
                continue
            if key == "stop" and (type(value) is str or type(value) is list and all(type(s) is str for s in value)):
                continue
            return False
        if type(value) not in spec[0] or not spec[1] <= value <= spec[2]:
            return False
    value = body[text]
    if url != c.CHAT:
        return type(value) is str and (url != c.RESPONSES or value != "")
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
