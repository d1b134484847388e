"""A table batch's answers as a table: each row's answer (or the JSON schema's typed columns, or the embedding),
its finish_reason, usage and error, at the row's position, beside the input's key columns."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa

from . import contract as c
from .results import error_code
from .structured import follows
from .table import (
    ANSWER,
    EMBEDDING,
    INVALID_STRUCTURED_OUTPUT,
    ROW,
    STRUCTURED_OUTPUT_CUT,
    RowError,
    TableRequest,
    check_key_columns,
    custom_id,
    row_of,
    schema_columns,
)


@dataclass
class Answered:
    """What a table batch gave back, counted."""

    rows: int = 0
    answered: int = 0
    failed: int = 0
    reused: int = 0
    cut: int = 0  # rows whose structured output max_tokens cut before its JSON ended
    invalid: int = 0  # rows whose whole structured output does not follow the schema
    computed: int = 0  # rows the engine ran now (answered or failed), not reused, not refused before it
    prompt_tokens: int = 0  # of the rows computed now (reused rows cost nothing)
    completion_tokens: int = 0
    errors: list[RowError] = field(default_factory=list)

    def to_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "answered": self.answered, "failed": self.failed, "reused": self.reused,
                "computed": self.computed, "cut": self.cut, "invalid": self.invalid,
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
    """The answer's values by column, or why it is not the schema's (the row is then named by the caller): the check
    every structured answer passes (structured.follows)."""
    value, violation = follows(text, schema)
    if violation is None:
        return value, None
    if finish_reason == "length":
        return {}, RowError(-1, STRUCTURED_OUTPUT_CUT, "The answer was cut at max_tokens before its JSON ended; "
                            "raise max_tokens.", "max_tokens")
    if value is None:
        return {}, RowError(-1, INVALID_STRUCTURED_OUTPUT, f"The answer is {violation.reason}.", "response_format")
    return {}, RowError(-1, INVALID_STRUCTURED_OUTPUT, f"The answer does not follow the schema: {violation.reason}",
                        violation.dotted)


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
            counts.invalid += problem is not None and problem.code == INVALID_STRUCTURED_OUTPUT
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
    # A new table: the upstream's schema metadata (a DataFrame's dtypes, for its own columns) is not its.
    table = keys.replace_schema_metadata(None).add_column(0, ROW, pa.array(range(keys.num_rows), type=pa.int64()))
    for f in spec.output_fields():
        table = table.append_column(f, pa.array(columns[f.name], type=f.type))
    return table, counts


def error_lines(errors: Iterable[RowError]) -> Iterator[dict[str, Any]]:
    """The rows that made no request, as error-file lines of their custom_ids."""
    for e in errors:
        yield c.request_error_line(custom_id(e.row), e.code, e.message, param=e.param)
