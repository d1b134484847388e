"""Structured answers: what a request's answer must follow (its JSON schema, a JSON object, its forced tool calls'
parameters), whether it does, and whether its token limit cut it short.

A line whose answer does not follow is kept as the engine returned it, marked with its first violation (the line's
`invalid_structured`: where the answer is, where in it, why), and counted (`request_counts.invalid_structured`), apart
from the answers cut at their token limit (`incomplete_structured`). A file batch's lines and a table batch's rows
are checked by the same functions.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from . import contract as c

OBJECT = {"type": "object"}  # a JSON object: json_object's answer, and any call's arguments (as at OpenAI)
MAX_REASON, MAX_POINTER = 300, 200  # the mark's text is bounded whatever the answer holds


@dataclass(frozen=True)
class Violation:
    """Why an answer does not follow what was asked: `answer`, where it is in the response body, and `pointer`, where
    in it the first violation is (both JSON pointers; "" is the whole answer)."""

    answer: str
    pointer: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"answer": self.answer, "pointer": self.pointer, "reason": self.reason}

    @property
    def dotted(self) -> str:
        """The pointer as a table batch names a field: `answer.tags[0]`."""
        parts = [_unescape(p) for p in self.pointer.split("/")[1:]]
        return "answer" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts)


@dataclass(frozen=True)
class Expected:
    """What a request asked its answer to be: text following `schema` (a JSON schema; OBJECT for json_object), one
    of `choices`, or forced tool calls (`tools`: each callable tool's parameters by name, None where it gave none;
    `single`: parallel_tool_calls false). Nothing of these: a regex or a grammar, not checked here (their answers are
    only counted when cut short)."""

    schema: Any = None
    choices: tuple[str, ...] | None = None
    tools: Mapping[str, Any] | None = None
    single: bool = False

    def check(self, body: dict[str, Any]) -> Violation | None:
        """The answer's first violation, or None: every choice's (or the response's)."""
        if self.tools is not None:
            return next(filter(None, (self._calls(at, calls) for at, calls in _tool_calls(body))), None)
        if self.schema is None and self.choices is None:
            return None
        return next(filter(None, (self._text(at, text) for at, text in _texts(body))), None)

    def _text(self, at: str, text: str | None) -> Violation | None:
        if self.choices is not None:
            return None if text in self.choices else Violation(at, "", _cut(f"{text!r} is not one of the choices"))
        return follows(text, self.schema, at)[1]

    def _calls(self, at: str, calls: list[tuple[str, Any, Any]]) -> Violation | None:
        assert self.tools is not None
        if not calls:
            return Violation(at, "", "no tool call, though tool_choice asked for one")
        if self.single and len(calls) > 1:
            return Violation(calls[1][0].removesuffix("/function"), "", "a second tool call, though "
                             "parallel_tool_calls is false")
        for call_at, name, arguments in calls:
            if name not in self.tools:
                wanted = " or ".join(map(repr, self.tools))
                return Violation(call_at + "/name", "", _cut(f"calls {name!r}, not {wanted}"))
            value, violation = follows(arguments, self.tools[name] or OBJECT, call_at + "/arguments")
            if violation is not None:
                return violation
            if not isinstance(value, dict):
                return Violation(call_at + "/arguments", "", "the arguments are not a JSON object")
        return None


def follows(text: Any, schema: Any, at: str = "") -> tuple[Any, Violation | None]:
    """The answer's JSON value, and its first violation of `schema` (None: it follows it)."""
    if not isinstance(text, str):
        return None, Violation(at, "", "no answer text")
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return None, Violation(at, "", _cut(f"not JSON: {exc}"))
    error = _first_error(schema, value)
    if error is None:
        return value, None
    pointer = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in error.absolute_path)
    return value, Violation(at, pointer[:MAX_POINTER], _cut(error.message))


def expected(endpoint: str, body: dict[str, Any]) -> Expected | None:
    """What the request asks its answer to be, or None when it asks for no structure. A forced tool call wins over a
    response format, as in vLLM (which ignores the format then)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools and endpoint in (c.CHAT, c.RESPONSES) and (choice == "required" or isinstance(choice, dict)):
        params = {name: params for name, params in map(_tool, tools) if name is not None}
        named = (choice.get("function") or {}).get("name") if endpoint == c.CHAT and isinstance(choice, dict) \
            else choice.get("name") if isinstance(choice, dict) else None
        if named is not None:
            params = {named: params.get(named)}
        return Expected(tools=params, single=body.get("parallel_tool_calls") is False)
    so = body.get("structured_outputs")
    if isinstance(so, dict) and any(so.get(k) is not None for k in ("json", "regex", "choice", "grammar",
                                                                        "json_object", "structural_tag")):
        if so.get("json") is not None:
            schema = orjson.loads(so["json"]) if isinstance(so["json"], str) else so["json"]
            return Expected(schema=schema)
        if isinstance(so.get("choice"), list):
            return Expected(choices=tuple(map(str, so["choice"])))
        return Expected(schema=OBJECT) if so.get("json_object") else Expected()
    text = body.get("text")
    fmt = text.get("format") if endpoint == c.RESPONSES and isinstance(text, dict) else body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    if fmt["type"] == "json_object":
        return Expected(schema=OBJECT)
    schema = fmt.get("schema") if endpoint == c.RESPONSES else (fmt.get("json_schema") or {}).get("schema")
    return Expected(schema=schema if schema is not None else True)


def expectations(endpoint: str, requests: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Expected]:
    """custom_id -> what its answer must be, for the requests that ask for structure."""
    return {cid: e for cid, body in requests if (e := expected(endpoint, body)) is not None}


def asks_structured(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether the request constrains its answer to a format: a JSON schema or object, vLLM's structured outputs,
    or a tool call it forces."""
    return expected(endpoint, body) is not None


def cut_short(body: dict[str, Any]) -> bool:
    """Whether an answer (a response body) stopped at its token limit: any choice, or the `response`."""
    if body.get("object") == "response":
        return body.get("status") == "incomplete"
    return any(isinstance(ch, dict) and ch.get("finish_reason") == "length" for ch in body.get("choices") or ())


def mark(line: dict[str, Any], expected: Expected) -> str | None:
    """Check a successful line's answer: marked with its first violation, if any. Which count it falls in:
    "incomplete_structured" (cut at its token limit, whether or not what it holds follows), "invalid_structured"
    (whole but not following), or None."""
    body = line["response"]["body"]
    violation = expected.check(body)
    if violation is not None:
        line[c.INVALID_STRUCTURED] = violation.to_dict()
    if cut_short(body):
        return "incomplete_structured"
    return "invalid_structured" if violation is not None else None


def flagged_ids(lines: Iterable[bytes], counts: Collection[str]) -> list[str]:
    """The custom_ids of an output file's (raw) lines marked as not following their schema, in file order: those
    whose answer is whole (`invalid_structured` in `counts`) and those cut short (`incomplete_structured`)."""
    ids = []
    for raw in lines:
        if raw.strip() and b'"' + c.INVALID_STRUCTURED.encode() + b'"' in raw:
            line = orjson.loads(raw)
            cut = cut_short(((line.get("response") or {}).get("body")) or {})
            if line.get(c.INVALID_STRUCTURED) and ("incomplete_structured" if cut else "invalid_structured") in counts:
                ids.append(line["custom_id"])
    return ids


# -- where the answers are in a response body --------------------------------------------------------------------

def _texts(body: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(where, text) of each answer text: a chat choice's content, a completion's text, a response's output text."""
    if body.get("object") == "response":
        parts = [(f"/output/{i}/content/{j}", part.get("text"))
                 for i, item in enumerate(body.get("output") or ()) if item.get("type") == "message"
                 for j, part in enumerate(item.get("content") or ()) if part.get("type") == "output_text"]
        if len(parts) == 1:
            yield parts[0][0] + "/text", parts[0][1]
        else:  # none, or several to read as one (the SDK's output_text)
            yield "/output", "".join(text or "" for _, text in parts) if parts else None
        return
    for i, choice in enumerate(body.get("choices") or ()):
        if "message" in choice:
            yield f"/choices/{i}/message/content", (choice.get("message") or {}).get("content")
        else:
            yield f"/choices/{i}/text", choice.get("text")


def _tool_calls(body: dict[str, Any]) -> Iterator[tuple[str, list[tuple[str, Any, Any]]]]:
    """(where, [(where, name, arguments) of each call]) of each answer's tool calls."""
    if body.get("object") == "response":
        yield "/output", [(f"/output/{i}", item.get("name"), item.get("arguments"))
                          for i, item in enumerate(body.get("output") or ()) if item.get("type") == "function_call"]
        return
    for i, choice in enumerate(body.get("choices") or ()):
        at = f"/choices/{i}/message/tool_calls"
        calls = (choice.get("message") or {}).get("tool_calls") or ()
        yield at, [(f"{at}/{k}/function", (call.get("function") or {}).get("name"),
                    (call.get("function") or {}).get("arguments")) for k, call in enumerate(calls)]


def _tool(tool: Any) -> tuple[str | None, Any]:
    """A function tool's name and parameters (chat's `function` object, or a response's flat tool)."""
    if not isinstance(tool, dict):
        return None, None
    inner = tool.get("function")
    function: dict[str, Any] = inner if isinstance(inner, dict) else tool
    return function.get("name"), function.get("parameters")


# -- the JSON schema check ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _validator(schema_json: bytes) -> Any:
    from jsonschema import validators

    schema = orjson.loads(schema_json)
    return validators.validator_for(schema)(schema)


def _first_error(schema: Any, value: Any) -> Any:
    """jsonschema's most relevant error (`best_match`) of `value` against `schema`, or None. A schema it cannot read is
    the request's problem, which the engine reports: the answer is not held against it."""
    from jsonschema.exceptions import best_match

    try:
        return best_match(_validator(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)).iter_errors(value))
    except Exception:  # an invalid schema, an unresolvable $ref: nothing to check against
        return None


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")
