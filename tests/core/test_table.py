"""Tables as batches: templates over a row's columns, the bad input each names by row and field, and the answers
back as typed columns."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import table as t
from batch_dagster.batchfile.table import RowError, TableRequest, TableSpecError
from batch_dagster.batchfile.table_answers import answers_table

SCHEMA = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                           "confidence": {"type": "number"}, "topic": {"type": "string"},
                                           "stars": {"type": "integer"}, "spam": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["sentiment", "confidence"]}


def spec(**fields) -> TableRequest:
    return TableRequest.from_dict({"model": "m", "system": "Label the review.", "user": "Review: {text}",
                                   "params": {"temperature": 0, "max_tokens": 40}, **fields})


def chat_line(row: int, text: str, finish: str = "stop", reused: bool = False, prompt: int = 10,
              completion: int = 5) -> dict:
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return c.reused_line(t.custom_id(row), body) if reused else c.success_line(t.custom_id(row), body)


def test_a_row_renders_to_a_chat_request_with_its_schema_as_response_format():
    s = spec(json_schema=SCHEMA)
    rendered = t.render(s, [{"text": "Great kettle", "id": 7}])
    assert rendered.errors == []
    line = orjson.loads(rendered.lines[0])
    assert line["custom_id"] == "row-0" and line["url"] == c.CHAT
    assert line["body"]["messages"] == [{"role": "system", "content": "Label the review."},
                                        {"role": "user", "content": "Review: Great kettle"}]
    assert line["body"]["response_format"]["json_schema"]["schema"] == SCHEMA
    assert line["body"]["temperature"] == 0 and s.deterministic()


def test_completions_and_embeddings_templates():
    completion = TableRequest.from_dict({"model": "m", "prompt": "Q: {q}\nA:", "params": {"seed": 3}})
    embedding = TableRequest.from_dict({"model": "e", "input": "{title}. {text}"})
    assert completion.endpoint == c.COMPLETIONS and completion.deterministic()
    assert embedding.endpoint == c.EMBEDDINGS and embedding.deterministic()
    assert orjson.loads(t.render(embedding, [{"title": "A", "text": "b"}]).lines[0])["body"]["input"] == "A. b"
    assert not TableRequest.from_dict({"model": "m", "user": "{q}"}).deterministic()  # temperature 1 by default


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"user": "{text.upper}"}, "user", "not a column name"),
    ({"user": "{text!r}"}, "user", "not a column name"),
    ({"user": "{text"}, "user", "not well formed"),
    ({"prompt": "{text}"}, "prompt", "exactly one of"),
    ({"params": {"temperature": "hot"}}, "params.temperature", "number"),
    ({"params": {"messages": []}}, "params.messages", "written from the template"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "json_schema.properties.a.type",
     "not valid JSON Schema"),
    ({"json_schema": {"type": "array"}}, "json_schema", "object schema with properties"),
    ({"temprature": 0}, "temprature", "unknown field"),
    ({"model": ""}, "model", "model name"),
])
def test_a_template_or_schema_no_row_could_run_names_its_field(fields, param, says):
    with pytest.raises(TableSpecError) as caught:
        spec(**fields)
    assert caught.value.param == param and says in str(caught.value)


def test_a_missing_column_is_named_before_anything_runs():
    assert t.missing_columns(spec(user="{title}: {text}"), ["id", "text"]) == ["title"]


def test_an_empty_cell_or_an_oversized_request_is_that_row_s_error_and_the_rest_render():
    rows = [{"text": "fine"}, {"text": None}, {"text": float("nan")}, {"text": "x" * 500}, {"text": "also fine"}]
    rendered = t.render(spec(), rows, c.Limits(max_line_bytes=400))
    assert [orjson.loads(line)["custom_id"] for line in rendered.lines] == ["row-0", "row-4"]
    assert [(e.row, e.code, e.param) for e in rendered.errors] == [
        (1, t.EMPTY_VALUE, "user"), (2, t.EMPTY_VALUE, "user"), (3, c.LINE_TOO_LARGE, "system, user")]
    assert rendered.errors[0].shown({"id": "r1"}) == \
        "row 1 (id=r1): [empty_value] Column 'text' is empty in this row. (field: user)"


def test_answers_become_typed_columns_and_every_row_gets_an_answer_or_an_error():
    s = spec(json_schema=SCHEMA)
    keys = pa.table({"review_id": ["a", "b", "c", "d", "e", "f"]})
    good = {"sentiment": "positive", "confidence": 0.9, "topic": "kettle", "stars": 5, "spam": False,
            "tags": ["home", "kitchen"]}
    lines = [
        chat_line(0, orjson.dumps(good).decode()),
        chat_line(1, '{"sentiment": "negative", "confidence": 0.', finish="length"),  # cut by max_tokens
        chat_line(2, "I think it is positive."),  # not JSON
        chat_line(3, '{"sentiment": "angry", "confidence": 1}'),  # not the schema's
        c.request_error_line("row-4", c.CONTEXT_LENGTH_EXCEEDED, "too long", param="messages"),
        chat_line(0, "a second line for row 0 is ignored"),
    ]
    table, counts = answers_table(s, keys, [*lines[:2], chat_line(5, orjson.dumps(good).decode(), reused=True),
                                              *lines[2:]])
    rows = table.to_pylist()
    assert table.schema.field("confidence").type == pa.float64() and table.schema.field("stars").type == pa.int64()
    assert table.schema.field("spam").type == pa.bool_() and table.schema.field("tags").type == pa.string()
    assert rows[0] == {"row": 0, "review_id": "a", "answer": orjson.dumps(good).decode(), "sentiment": "positive",
                            "confidence": 0.9, "topic": "kettle", "stars": 5, "spam": False,
                            "tags": '["home","kitchen"]', "finish_reason": "stop", "prompt_tokens": 10,
                            "completion_tokens": 5, "reused": False, "error_code": None, "error": None}
    assert [r["error_code"] for r in rows] == [None, t.STRUCTURED_OUTPUT_CUT, t.INVALID_STRUCTURED_OUTPUT,
                                               t.INVALID_STRUCTURED_OUTPUT, c.CONTEXT_LENGTH_EXCEEDED, None]
    assert "(field: answer.sentiment)" in rows[3]["error"] and "(field: messages)" in rows[4]["error"]
    assert rows[5]["reused"] is True and rows[5]["sentiment"] == "positive"
    assert counts.to_dict() == {"rows": 6, "answered": 2, "failed": 4, "reused": 1, "computed": 5, "cut": 1,
                                "invalid": 2, "prompt_tokens": 40, "completion_tokens": 20}  # the reused row costs nothing
    for r in rows:  # each row answered (its answer typed) or failed (its error named), never both, never neither
        assert (r["error_code"] is None) == (r["error"] is None)
        assert (r["error_code"] is None) == (r["sentiment"] is not None)


def test_a_row_with_no_line_is_an_error_not_an_empty_answer():
    table, counts = answers_table(spec(), pa.table({"id": [1, 2]}), [chat_line(0, "ok")],
                                    [])
    assert table.column("error_code").to_pylist() == [None, "missing_answer"] and counts.failed == 1


def test_render_errors_take_their_rows_and_embeddings_come_back_as_vectors():
    s = TableRequest.from_dict({"model": "e", "input": "{text}"})
    line = c.success_line("row-1", {"object": "list", "data": [{"embedding": [0.5, -1.0]}],
                                    "usage": {"prompt_tokens": 3, "total_tokens": 3}})
    table, counts = answers_table(s, pa.table({"id": [1, 2]}), [line], [RowError(0, t.EMPTY_VALUE, "empty", "input")])
    assert table.column("embedding").to_pylist() == [None, [0.5, -1.0]]
    assert table.column("error_code").to_pylist() == [t.EMPTY_VALUE, None] and counts.answered == 1


@pytest.mark.parametrize("name", ["answer", "row", "error"])
def test_a_key_column_named_like_an_answer_column_is_refused(name):
    with pytest.raises(TableSpecError, match="answer column"):
        answers_table(spec(), pa.table({name: [1]}), [chat_line(0, "x")])
