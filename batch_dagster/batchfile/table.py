"""Tables as batches: a request template filled in from each row, and each row's answer back as typed columns.

A row becomes one request whose custom_id is `row-<index>` (its position in the table, from 0); its answer (or its
error) comes back to the same position. The template names the row's columns as `{column}`; a JSON schema's
properties become the answer's columns, typed.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from . import contract as c
from .bodies import BodyError, check_body
from .results import error_code

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
        line = orjson.dumps({"custom_id": custom_id(index), "method": "POST", "url": endpoint, "body": body})
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


@dataclass
class Answered:
    """What a table batch gave back, counted."""

    rows: int = 0
    answered: int = 0
    failed: int = 0
    reused: int = 0
    cut: int = 0  # rows whose structured output max_tokens cut before its JSON ended
    computed: int = 0  # rows the engine ran now (answered or failed), not reused, not refused before it
    prompt_tokens: int = 0  # of the rows computed now (reused rows cost nothing)
    completion_tokens: int = 0
    errors: list[RowError] = field(default_factory=list)

    def to_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "answered": self.answered, "failed": self.failed, "reused": self.reused,
                "computed": self.computed, "cut": self.cut,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


def _coerce(value: Any, kind: pa.DataType) -> Any:
    if value is None:
        return None
    if kind == pa.string():
        return value if isinstance(value, str) else orjson.dumps(value).decode()
    if kind == pa.bool_():
        return value if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if kind == pa.int64() and float(value).is_integer() else float(value) \
        if kind == pa.float64() else None


def structured(text: str, schema: Mapping[str, Any], finish_reason: str | None
               ) -> tuple[dict[str, Any], RowError | None]:
    """The answer's values by column, or why it is not the schema's (the row is then named by the caller)."""
    from jsonschema import validators

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if finish_reason == "length":
            return {}, RowError(-1, STRUCTURED_OUTPUT_CUT, "The answer was cut at max_tokens before its JSON ended; "
                                "raise max_tokens.", "max_tokens")
        return {}, RowError(-1, INVALID_STRUCTURED_OUTPUT, f"The answer is not JSON: {exc}.", "response_format")
    errors = sorted(validators.validator_for(schema)(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in errors[0].path)
        return {}, RowError(-1, INVALID_STRUCTURED_OUTPUT, f"The answer does not follow the schema: "
                            f"{errors[0].message[:300]}", "answer" + path)
    return value, None


def _line_error(row: int, line: dict[str, Any]) -> RowError:
    """An error line's code, message and param."""
    if line.get("error"):
        return RowError(row, line["error"].get("code") or "unknown", line["error"].get("message") or "")
    error = ((line.get("response") or {}).get("body") or {}).get("error") or {}
    return RowError(row, error_code(line), str(error.get("message") or ""), error.get("param"))


def answers(spec: TableRequest, rows: int, lines: Iterable[dict[str, Any]], errors: Iterable[RowError] = ()
            ) -> tuple[dict[str, list[Any]], Answered]:
    """The answer columns (by name, one value per row, in row order) from the batch's output and error lines and
    the rows that made no request; and the counts. A row with neither gets a `missing_answer` error: never
    silently empty."""
    fields = spec.output_fields()
    columns: dict[str, list[Any]] = {f.name: [None] * rows for f in fields}
    kinds = {f.name: f.type for f in fields}
    counts = Answered(rows=rows)
    seen = [False] * rows

    def fail(error: RowError) -> None:
        columns["error_code"][error.row] = error.code
        columns["error"][error.row] = error.message + (f" (field: {error.param})" if error.param else "")
        counts.failed += 1
        counts.errors.append(error)

    for error in errors:
        seen[error.row] = True
        fail(error)
    for line in lines:
        row = row_of(str(line.get("custom_id")))
        if row is None or not 0 <= row < rows or seen[row]:
            continue
        seen[row] = True
        reused = bool(line.get(c.REUSED))
        columns["reused"][row] = reused
        counts.reused += reused
        counts.computed += not reused and line.get("response") is not None  # a line not run has no response
        if not c.is_success(line):
            fail(_line_error(row, line))
            continue
        body = line["response"]["body"]
        usage = body.get("usage") or {}
        columns["prompt_tokens"][row] = usage.get("prompt_tokens")
        columns["completion_tokens"][row] = usage.get("completion_tokens")
        if not reused:
            counts.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            counts.completion_tokens += int(usage.get("completion_tokens") or 0)
        if spec.endpoint == c.EMBEDDINGS:
            columns[EMBEDDING][row] = (body.get("data") or [{}])[0].get("embedding")
            counts.answered += 1
            continue
        choice = (body.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
        finish = choice.get("finish_reason")
        columns[ANSWER][row], columns["finish_reason"][row] = text, finish
        if spec.json_schema is not None:
            counts.cut += finish == "length"
            values, problem = structured(text or "", spec.json_schema, finish)
            if problem is not None:
                fail(RowError(row, problem.code, problem.message, problem.param))
                continue
            for name, _ in schema_columns(spec.json_schema):
                columns[name][row] = _coerce(values.get(name), kinds[name])
        counts.answered += 1
    for row in (i for i, s in enumerate(seen) if not s):
        fail(RowError(row, "missing_answer", "The batch returned no line for this row."))
    return columns, counts


def answers_table(spec: TableRequest, keys: pa.Table, lines: Iterable[dict[str, Any]],
                  errors: Iterable[RowError] = ()) -> tuple[pa.Table, Answered]:
    """The answered table: `row` (the row's position in the input), the input's key columns, then the answer
    columns (see `answers`)."""
    check_key_columns(spec, keys.column_names)
    columns, counts = answers(spec, keys.num_rows, lines, errors)
    table = keys.add_column(0, ROW, pa.array(range(keys.num_rows), type=pa.int64()))
    for f in spec.output_fields():
        table = table.append_column(f, pa.array(columns[f.name], type=f.type))
    return table, counts


def error_lines(errors: Iterable[RowError]) -> Iterator[dict[str, Any]]:
    """The rows that made no request, as error-file lines of their custom_ids."""
    for e in errors:
        yield c.request_error_line(custom_id(e.row), e.code, e.message, param=e.param)


# Tables dropped into the inbox or a bucket: a Parquet or CSV file with a sidecar beside it that says what to ask.

TABLE_SUFFIXES = (".parquet", ".csv")
SIDECAR_SUFFIX = ".batch.yaml"
MAX_SIDECAR_BYTES = 256 * 1024


def is_table(name: str) -> bool:
    return name.lower().endswith(TABLE_SUFFIXES)


def sidecar_name(table_name: str) -> str:
    """The sidecar of a dropped table: `reviews.csv` -> `reviews.batch.yaml`, in the same folder."""
    stem, _, _ = table_name.rpartition(".")
    return stem + SIDECAR_SUFFIX


def answered_name(table_name: str) -> str:
    """The answered table written with a dropped table's results: `reviews.csv` -> `reviews.answers.csv`."""
    stem, _, suffix = table_name.rpartition(".")
    return f"{stem}.answers.{suffix}"


@dataclass(frozen=True)
class Sidecar:
    """What a dropped table asks (the component's `request` fields) and the columns copied beside the answers
    (`key_columns`; default: every column of the table)."""

    request: TableRequest
    key_columns: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, data: bytes, name: str = "the sidecar") -> Sidecar:
        """From the sidecar's bytes (YAML, or JSON, which is YAML); TableSpecError naming `name` and the field."""
        import yaml

        if len(data) > MAX_SIDECAR_BYTES:
            raise TableSpecError(f"{name} is {len(data)} bytes; a sidecar may be at most {MAX_SIDECAR_BYTES}", name)
        try:
            fields = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise TableSpecError(f"{name} is not YAML or JSON: {str(exc)[:300]}", name) from None
        if not isinstance(fields, dict):
            raise TableSpecError(f"{name} must be a mapping of the request's fields", name)
        keys = fields.pop("key_columns", None)
        if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
            raise TableSpecError("must be a list of column names", "key_columns")
        return cls(TableRequest.from_dict(fields), tuple(keys) if keys is not None else None)


def read_table(path: Path | str) -> pa.Table:
    """A Parquet or CSV file as a table (CSV columns typed as pyarrow infers them; an empty CSV cell is empty, not
    the empty text)."""
    if str(path).lower().endswith(".csv"):
        import pyarrow.csv as pcsv

        return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(strings_can_be_null=True))
    import pyarrow.parquet as pq

    return pq.read_table(path)


def write_table(table: pa.Table, path: Path | str) -> None:
    """A table as Parquet, or as CSV for a `.csv` path (embeddings and other lists as JSON text there)."""
    if str(path).lower().endswith(".csv"):
        import pyarrow.csv as pcsv

        for i, f in enumerate(table.schema):
            if pa.types.is_list(f.type):
                text = [None if v is None else orjson.dumps(v).decode() for v in table.column(i).to_pylist()]
                table = table.set_column(i, f.name, pa.array(text, type=pa.string()))
        pcsv.write_csv(table, path)
        return
    import pyarrow.parquet as pq

    pq.write_table(table, path)
