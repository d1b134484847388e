"""Tables as batches: a request template filled in from each row (the answers come back as typed columns:
table_answers.py; tables as files and dropped tables' sidecars: table_files.py).

A row becomes one request whose custom_id is `row-<index>` (its position in the table, from 0); its answer (or its
error) comes back to the same position. The template names the row's columns as `{column}`; a JSON schema's
properties become the answer's columns, typed.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa

from . import contract as c
from .bodies import BodyError, check_body

ROW_PREFIX = "row-"
# The template's parts, by the request field each one fills (chat: system and user; completions; embeddings).
TEXT_FIELDS = ("system", "user", "prompt", "input")
# Body fields the template writes itself: `params` may not set them.
OWN_FIELDS = frozenset({"model", "messages", "prompt", "input", "response_format", "stream", "stream_options"})
# The answer's columns after the key columns (the schema's properties come between `answer` and these).
TAIL_COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "reused", "error_code", "error")
ANSWER, EMBEDDING, ROW = "answer", "embedding", "row"
# Codes of the rows whose answer is not the schema's (beside the engine's and validation's own).
EMPTY_VALUE = "empty_value"
REQUEST_TOO_LARGE = c.LINE_TOO_LARGE
STRUCTURED_OUTPUT_CUT = "structured_output_cut"
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"
_ARROW = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


class TableSpecError(ValueError):
    """A request template or schema that cannot work for any row: what is wrong and in which field."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def custom_id(row: int) -> str:
    return f"{ROW_PREFIX}{row}"


def row_of(cid: str) -> int | None:
    """The row a custom_id of a table batch stands for, or None."""
    tail = cid.removeprefix(ROW_PREFIX)
    return int(tail) if cid.startswith(ROW_PREFIX) and tail.isdigit() else None


def parse_template(text: str, param: str) -> list[str | tuple[str]]:
    """A template's literal parts (str) and the columns it names (1-tuples), in order. `{{` and `}}` are braces.

    Only plain column names: a format spec, a conversion, an attribute or an index (`{a.b}`, `{a[0]}`, `{a!r}`,
    `{a:>5}`) is refused, so a template can read nothing of a value but its text.
    """
    parts: list[str | tuple[str]] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise TableSpecError(f"the template is not well formed ({exc}); write a literal brace as {{{{ or }}}}",
                             param) from None
    for literal, name, spec, conversion in parsed:
        if literal:
            parts.append(literal)
        if name is None:
            continue
        if not name.strip() or spec or conversion or any(ch in name for ch in ".[]"):
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise TableSpecError(f"{{{shown}}} is not a column name; a template names columns as {{column}}",
                                 param)
        parts.append((name,))
    return parts


def _text(value: Any) -> str | None:
    """A cell as the template writes it; None for an empty cell (null, NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (dict, list, tuple)):
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=str).decode()
    return str(value)


@dataclass(frozen=True)
class RowError:
    """Why one row has no answer: its code, message and the field at fault."""

    row: int
    code: str
    message: str
    param: str | None = None

    def shown(self, keys: Mapping[str, Any] | None = None) -> str:
        """`row 17 (review_id=r017): [code] message (field: user)`, as a log line names it."""
        named = ", ".join(f"{k}={_text(v)}" for k, v in (keys or {}).items())
        where = f"row {self.row}" + (f" ({named})" if named else "")
        return f"{where}: [{self.code}] {self.message}" + (f" (field: {self.param})" if self.param else "")


@dataclass(frozen=True)
class TableRequest:
    """What each row asks, and of which model: system and user messages (chat), a prompt (completions) or the text
    to embed (embeddings), each a template over the row's columns; sampling `params`; an optional JSON `schema`
    the answer must follow (chat and completions), whose properties become typed columns."""

    model: str
    user: str | None = None
    system: str | None = None
    prompt: str | None = None
    input: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    json_schema: Mapping[str, Any] | None = None
    schema_name: str = "answer"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> TableRequest:
        """From a sidecar's or a component's mapping; unknown keys are refused (a typo is never ignored)."""
        names = {"model", "params", "json_schema", "schema_name", *TEXT_FIELDS}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TableSpecError(f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
                                 f"{', '.join(sorted(names))}", where + unknown[0])
        model = data.get("model")
        if not isinstance(model, str) or not model or len(model) > c.MAX_MODEL_CHARS:
            raise TableSpecError(f"must be a model name of 1 to {c.MAX_MODEL_CHARS} characters", where + "model")
        for name in TEXT_FIELDS:
            if data.get(name) is not None and not isinstance(data[name], str):
                raise TableSpecError("must be a text template", where + name)
        params, schema = data.get("params") or {}, data.get("json_schema")
        if not isinstance(params, Mapping):
            raise TableSpecError("must be a mapping of request fields", where + "params")
        if schema is not None and not isinstance(schema, Mapping):
            raise TableSpecError("must be a JSON schema (an object)", where + "json_schema")
        spec = cls(model=model, **{n: data.get(n) for n in TEXT_FIELDS}, params=dict(params), json_schema=schema,
                   schema_name=str(data.get("schema_name") or "answer"))
        spec.check(where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """The fields from_dict reads back."""
        fields = {"model": self.model, **self.templates(), "params": dict(self.params)}
        if self.json_schema is not None:
            fields |= {"json_schema": dict(self.json_schema), "schema_name": self.schema_name}
        return fields

    @property
    def endpoint(self) -> str:
        if self.input is not None:
            return c.EMBEDDINGS
        return c.COMPLETIONS if self.prompt is not None else c.CHAT

    def templates(self) -> dict[str, str]:
        """The template of each text field that has one, by field name."""
        return {name: getattr(self, name) for name in TEXT_FIELDS if getattr(self, name) is not None}

    def columns(self) -> list[str]:
        """The columns the templates name, in order of first use."""
        seen: dict[str, None] = {}
        for name, text in self.templates().items():
            for part in parse_template(text, name):
                if isinstance(part, tuple):
                    seen[part[0]] = None
        return list(seen)

    def check(self, where: str = "") -> None:
        """Refuse what no row could run: no text field or two kinds of them, a bad template, params that are not
        request fields or the wrong type, a schema that is not JSON Schema. Each error names its field."""
        kinds = [n for n in ("user", "prompt", "input") if getattr(self, n) is not None]
        if len(kinds) != 1:
            raise TableSpecError("give exactly one of user (chat, with an optional system), prompt (completions) "
                                 "or input (embeddings)", where + (kinds[1] if kinds else "user"))
        if self.system is not None and self.user is None:
            raise TableSpecError("a system message goes with a user message (chat)", where + "system")
        for name, text in self.templates().items():
            parse_template(text, where + name)
        own = sorted(set(self.params) & OWN_FIELDS)
        if own:
            raise TableSpecError(f"{own[0]!r} is written from the template and the schema, not from params",
                                 f"{where}params.{own[0]}")
        if self.json_schema is not None:
            if self.endpoint == c.EMBEDDINGS:
                raise TableSpecError("an embedding has no schema", where + "json_schema")
            check_schema(self.json_schema, where + "json_schema")
        try:
            check_body(self.endpoint, self.body({name: "x" for name in self.columns()}))
        except BodyError as exc:
            param = exc.param.removeprefix("body.")
            top = re.split(r"[.\[]", param)[0]
            raise TableSpecError(str(exc), where + (f"params.{param}" if top in self.params else param)) from None

    def deterministic(self) -> bool:
        """Whether the same row always gets the same answer: an embedding, or temperature 0, or a seed."""
        return self.endpoint == c.EMBEDDINGS or self.params.get("temperature") == 0 or \
            self.params.get("seed") is not None

    def _fill(self, name: str, row: Mapping[str, Any], index: int) -> str:
        out = []
        for part in parse_template(getattr(self, name), name):
            if isinstance(part, str):
                out.append(part)
                continue
            value = _text(row[part[0]])
            if value is None:
                raise RowFailure(RowError(index, EMPTY_VALUE, f"Column {part[0]!r} is empty in this row.", name))
            out.append(value)
        return "".join(out)

    def body(self, row: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
        """The request body for one row (RowFailure when a column it names is empty)."""
        body: dict[str, Any] = {"model": self.model, **self.params}
        if self.endpoint == c.EMBEDDINGS:
            body["input"] = self._fill("input", row, index)
        elif self.endpoint == c.COMPLETIONS:
            body["prompt"] = self._fill("prompt", row, index)
        else:
            system = [{"role": "system", "content": self._fill("system", row, index)}] if self.system else []
            body["messages"] = [*system, {"role": "user", "content": self._fill("user", row, index)}]
        if self.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": self.schema_name, "schema": dict(self.json_schema), "strict": True}}
        return body

    def output_fields(self) -> list[pa.Field]:
        """The answer's columns: the answer text (or the embedding), the schema's properties, then the tail."""
        if self.endpoint == c.EMBEDDINGS:
            head = [pa.field(EMBEDDING, pa.list_(pa.float32()))]
        else:
            head = [pa.field(ANSWER, pa.string())] + [pa.field(name, kind) for name, kind in schema_columns(
                self.json_schema or {})]
        return head + [pa.field("finish_reason", pa.string()), pa.field("prompt_tokens", pa.int64()),
                       pa.field("completion_tokens", pa.int64()), pa.field("reused", pa.bool_()),
                       pa.field("error_code", pa.string()), pa.field("error", pa.string())]


class RowFailure(Exception):
    def __init__(self, error: RowError):
        super().__init__(error.message)
        self.error = error


def check_schema(schema: Mapping[str, Any], param: str = "json_schema") -> None:
    """A schema the answers can follow: valid JSON Schema (its own metaschema), an object with properties."""
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise TableSpecError(f"not valid JSON Schema: {exc.message}", param + path) from None
    if schema.get("type") != "object" or not isinstance(schema.get("properties"), Mapping) or \
            not schema["properties"]:
        raise TableSpecError("must be an object schema with properties (each becomes a column)", param)


def _json_type(prop: Any) -> str | None:
    kind = prop.get("type") if isinstance(prop, Mapping) else None
    if isinstance(kind, list):  # ["string", "null"]: the one that is not null
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and isinstance(prop, Mapping) and isinstance(prop.get("enum"), list) and \
            all(isinstance(v, str) for v in prop["enum"]):
        kind = "string"
    return kind if isinstance(kind, str) else None


def schema_columns(schema: Mapping[str, Any]) -> list[tuple[str, pa.DataType]]:
    """Each property's column and its type: string, integer, number and boolean as such; anything else (arrays,
    objects, unions) as its JSON text."""
    return [(name, _ARROW.get(_json_type(prop) or "", pa.string()))
            for name, prop in (schema.get("properties") or {}).items()]


@dataclass
class Rendered:
    """The rows rendered: the JSONL lines of those that make a request, the errors of those that do not."""

    lines: list[bytes] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)

    def payload(self) -> bytes:
        """The batch's input file: the lines, each ended."""
        return b"".join(line + b"\n" for line in self.lines)


def render(spec: TableRequest, rows: Iterable[Mapping[str, Any]], limits: c.Limits = c.Limits()) -> Rendered:
    """One request line per row, in row order (custom_id `row-<index>`); a row that cannot make one (an empty
    column it names, a request longer than a line may be) is an error of its own and the others go on."""
    out = Rendered()
    endpoint = spec.endpoint
    for index, row in enumerate(rows):
        try:
            body = spec.body(row, index)
        except RowFailure as exc:
            out.errors.append(exc.error)
            continue
        line = c.one_line(orjson.dumps({"custom_id": custom_id(index), "method": "POST", "url": endpoint,
                                        "body": body}))
        if len(line) > limits.max_line_bytes:
            fields = ", ".join(spec.templates())
            out.errors.append(RowError(index, REQUEST_TOO_LARGE, f"The request made of this row is {len(line)} "
                                       f"bytes; a request may be at most {limits.max_line_bytes}.", fields))
            continue
        out.lines.append(line)
    return out


def check_key_columns(spec: TableRequest, key_columns: Sequence[str]) -> None:
    """Refuse a key column that has the name of an answer column."""
    clash = sorted(set(key_columns) & {ROW, *(f.name for f in spec.output_fields())})
    if clash:
        raise TableSpecError(f"key column {clash[0]!r} has the name of an answer column", "key_columns")


def missing_columns(spec: TableRequest, columns: Sequence[str]) -> list[str]:
    """The columns the templates name that the table does not have."""
    return [name for name in spec.columns() if name not in columns]
