"""Validation of batch input files: every error code with its 1-based physical line and param."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.validate import MAX_ERRORS, validate_file, validate_stream

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
MODEL = "smollm2-135m-instruct"


def chat(cid: str, model: str = MODEL, **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": f"hello {cid}"}], **body},
    }


def completion(cid: str, model: str = MODEL) -> dict:
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": {"model": model, "prompt": "Once"}}


def embedding(cid: str, model: str = "all-minilm-l6-v2") -> dict:
    return {"custom_id": cid, "method": "POST", "url": EMBEDDINGS, "body": {"model": model, "input": "text"}}


def dumps(obj) -> str:
    return obj if isinstance(obj, str) else json.dumps(obj)


def write(tmp_path: Path, lines, *, name: str = "in.jsonl", sep: str = "\n", trailing: bool = True) -> Path:
    """Write lines (dicts become JSON, str is written as is) to a file."""
    text = sep.join(dumps(x) for x in lines) + (sep if trailing and lines else "")
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def codes(report) -> list[tuple[str, int | None, str | None]]:
    return [(e.code, e.line, e.param) for e in report.errors]


def only_error(report):
    assert not report.valid
    assert report.error_count == 1, codes(report)
    assert len(report.errors) == 1
    return report.errors[0]


# --- valid files ----------------------------------------------------------------------------


def test_valid_chat_file(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b"), chat("c")])
    report = validate_file(path)
    assert report.valid
    assert report.errors == []
    assert report.error_count == 0
    assert report.total_requests == 3
    assert report.model == MODEL
    assert report.endpoint == CHAT


@pytest.mark.parametrize(
    ("make", "endpoint", "model"),
    [(completion, COMPLETIONS, MODEL), (embedding, EMBEDDINGS, "all-minilm-l6-v2")],
)
def test_valid_other_endpoints(tmp_path, make, endpoint, model):
    path = write(tmp_path, [make("x"), make("y")])
    report = validate_file(path)
    assert report.valid, codes(report)
    assert (report.total_requests, report.model, report.endpoint) == (2, model, endpoint)


def test_valid_with_list_prompt_and_list_input(tmp_path):
    comp = completion("a")
    comp["body"]["prompt"] = ["one", "two"]
    emb = embedding("b")
    emb["body"]["input"] = ["x", "y"]
    assert validate_file(write(tmp_path, [comp], name="c.jsonl")).valid
    assert validate_file(write(tmp_path, [emb], name="e.jsonl")).valid


def test_valid_file_without_trailing_newline(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b")], trailing=False)
    report = validate_file(path)
    assert report.valid
    assert report.total_requests == 2


def test_to_dict_shape(tmp_path):
    path = write(tmp_path, [chat("a"), "{not json"])
    d = validate_file(path).to_dict()
    assert d["valid"] is False
    assert d["total_requests"] == 2
    assert d["model"] == MODEL
    assert d["endpoint"] == CHAT
    assert d["error_count"] == 1
    assert d["errors"] == [{"code": "invalid_json", "message": d["errors"][0]["message"], "line": 2, "param": None}]
    assert isinstance(d["errors"][0]["message"], str) and d["errors"][0]["message"]
    json.dumps(d)  # serializable


def test_validate_stream_accepts_a_binary_stream():
    data = (json.dumps(chat("a")) + "\n" + json.dumps(chat("a")) + "\n").encode()
    report = validate_stream(io.BytesIO(data))
    assert codes(report) == [("duplicate_custom_id", 2, "custom_id")]


# --- file-level errors ----------------------------------------------------------------------


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    err = only_error(validate_file(path))
    assert (err.code, err.line, err.param) == ("empty_file", None, None)


@pytest.mark.parametrize("content", [b"\n", b"\n\n\n", b"  \n\t\n\r\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n\n"])
def test_blank_only_file_is_empty(tmp_path, content):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(content)
    report = validate_file(path)
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("empty_file", None, None)
    assert report.total_requests == 0


def test_file_too_large(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b")])
    size = path.stat().st_size
    report = validate_file(path, limits=c.Limits(max_bytes=size - 1))
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("file_too_large", None, None)
    # Exactly at the limit is fine.
    assert validate_file(path, limits=c.Limits(max_bytes=size)).valid


def test_file_too_large_still_reports_line_errors(tmp_path):
    path = write(tmp_path, [chat("a"), "nope"])
    report = validate_file(path, limits=c.Limits(max_bytes=10))
    assert codes(report) == [("file_too_large", None, None), ("invalid_json", 2, None)]


def test_too_many_requests(tmp_path):
    path = write(tmp_path, [chat(f"r{i}") for i in range(4)])
    report = validate_file(path, limits=c.Limits(max_requests=3))
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("too_many_requests", None, None)
    assert report.total_requests == 4
    assert validate_file(path, limits=c.Limits(max_requests=4)).valid


def test_blank_lines_do_not_count_toward_max_requests(tmp_path):
    path = write(tmp_path, [chat("a"), "", "", chat("b"), ""])
    report = validate_file(path, limits=c.Limits(max_requests=2))
    assert report.valid, codes(report)
    assert report.total_requests == 2


def test_default_limits_match_the_contract():
    limits = c.Limits()
    assert limits.max_requests == 50_000
    assert limits.max_bytes == 200 * 1024 * 1024
    assert limits.max_line_bytes == 6 * 1024 * 1024


# --- line_too_large -------------------------------------------------------------------------


def test_line_too_large_and_later_lines_still_validated(tmp_path):
    big = chat("big")
    big["body"]["messages"] = [{"role": "user", "content": "x" * 500}]
    lines = [chat("a"), big, chat("b"), "{bad", chat("a")]
    path = write(tmp_path, lines)
    report = validate_file(path, limits=c.Limits(max_line_bytes=200))
    assert codes(report) == [
        ("line_too_large", 2, None),
        ("invalid_json", 4, None),
        ("duplicate_custom_id", 5, "custom_id"),
    ]
    assert report.total_requests == 5


def test_line_too_large_much_longer_than_read_chunk(tmp_path):
    # A line far beyond the limit (several read chunks) is skipped whole; numbering stays right.
    huge = chat("huge")
    huge["body"]["messages"][0]["content"] = "y" * (3 * (1 << 20))
    path = write(tmp_path, [chat("a"), huge, "", "[1]", chat("b")])
    report = validate_file(path, limits=c.Limits(max_line_bytes=1000))
    assert codes(report) == [("line_too_large", 2, None), ("invalid_request", 4, None)]


def test_line_exactly_at_limit_is_accepted_with_lf_and_crlf(tmp_path):
    line = json.dumps(chat("a"))
    n = len(line.encode())
    for sep in ("\n", "\r\n"):
        path = write(tmp_path, [line, line.replace('"a"', '"b"')], sep=sep)
        report = validate_file(path, limits=c.Limits(max_line_bytes=n))
        assert report.valid, (sep, codes(report))
        report = validate_file(path, limits=c.Limits(max_line_bytes=n - 1))
        assert codes(report) == [("line_too_large", 1, None), ("line_too_large", 2, None)], sep


def test_line_too_large_on_last_line_without_newline(tmp_path):
    path = write(tmp_path, [chat("a"), "z" * 300], trailing=False)
    report = validate_file(path, limits=c.Limits(max_line_bytes=200))
    assert codes(report) == [("line_too_large", 2, None)]


def test_line_too_large_on_first_line_with_bom(tmp_path):
    # The BOM must not hide an oversized first line or split it into two lines.
    long_first = json.dumps(chat("a", temperature=0.5, note="q" * 100))
    second = json.dumps(chat("b"))
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + long_first.encode() + b"\n" + second.encode() + b"\n")
    limit = len(long_first.encode()) - 5
    report = validate_file(path, limits=c.Limits(max_line_bytes=limit))
    assert codes(report) == [("line_too_large", 1, None)]
    assert report.total_requests == 2


def test_bom_first_line_exactly_at_limit_is_accepted(tmp_path):
    # The limit is on the line's content; a BOM in front of line 1 is not part of it.
    first = json.dumps(chat("a"))
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + first.encode() + b"\r\n" + json.dumps(chat("b")).encode() + b"\r\n")
    report = validate_file(path, limits=c.Limits(max_line_bytes=len(first.encode())))
    assert report.valid, codes(report)
    assert report.total_requests == 2


# --- encoding and JSON ----------------------------------------------------------------------


def test_invalid_encoding(tmp_path):
    good = json.dumps(chat("a")).encode()
    bad = b'{"custom_id": "b\xff\xfe", "method": "POST"}'
    path = tmp_path / "enc.jsonl"
    path.write_bytes(good + b"\n" + bad + b"\n" + json.dumps(chat("c")).encode() + b"\n")
    report = validate_file(path)
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("invalid_encoding", 2, None)


def test_latin1_line_is_invalid_encoding(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(chat("caf\u00e9"), ensure_ascii=False).encode("latin-1") + b"\n")
    assert codes(validate_file(path)) == [("invalid_encoding", 1, None)]


def test_non_ascii_utf8_is_fine(tmp_path):
    req = chat("\u8bf7\u6c42-1")
    req["body"]["messages"][0]["content"] = "\u628a\u8fd9\u53e5\u8bdd\u7ffb\u8bd1\u6210\u82f1\u6587 \U0001f600"
    path = tmp_path / "zh.jsonl"
    path.write_bytes(json.dumps(req, ensure_ascii=False).encode("utf-8") + b"\n")
    assert validate_file(path).valid


@pytest.mark.parametrize("text", ["{", "not json", '{"custom_id": "a",}', "{'a': 1}", '{"a": 1} trailing'])
def test_invalid_json(tmp_path, text):
    path = write(tmp_path, [chat("a"), text])
    assert codes(validate_file(path)) == [("invalid_json", 2, None)]


# --- invalid_request ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "42", "null", "true"])
def test_not_an_object(tmp_path, text):
    path = write(tmp_path, [chat("a"), text])
    err = only_error(validate_file(path))
    assert (err.code, err.line, err.param) == ("invalid_request", 2, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("custom_id", None),
        ("custom_id", 7),
        ("custom_id", ""),
        ("custom_id", ["a"]),
        ("method", None),
        ("method", 1),
        ("method", ""),
        ("url", None),
        ("url", {"path": CHAT}),
        ("url", ""),
        ("body", None),
        ("body", "text"),
        ("body", []),
    ],
)
def test_top_level_field_missing_or_wrong_type(tmp_path, field, value):
    bad = chat("zz")
    if value is None:
        del bad[field]
    else:
        bad[field] = value
    path = write(tmp_path, [chat("a"), "", bad])
    report = validate_file(path)
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("invalid_request", 3, field)
    assert field in err.message


def test_explicit_null_field_is_reported(tmp_path):
    bad = chat("zz")
    bad["custom_id"] = None
    path = write(tmp_path, [bad])
    assert codes(validate_file(path)) == [("invalid_request", 1, "custom_id")]


@pytest.mark.parametrize("model", [None, "", 3, ["m"]])
def test_body_model_missing_or_wrong_type(tmp_path, model):
    bad = chat("b")
    if model is None:
        del bad["body"]["model"]
    else:
        bad["body"]["model"] = model
    path = write(tmp_path, [chat("a"), bad])
    assert codes(validate_file(path)) == [("invalid_request", 2, "body.model")]


@pytest.mark.parametrize("messages", ["missing", None, "hello", [], {"role": "user"}])
def test_chat_without_messages_list(tmp_path, messages):
    bad = chat("b")
    if messages == "missing":
        del bad["body"]["messages"]
    else:
        bad["body"]["messages"] = messages
    path = write(tmp_path, [chat("a"), bad])
    assert codes(validate_file(path)) == [("invalid_request", 2, "body.messages")]


@pytest.mark.parametrize("prompt", ["missing", None])
def test_completions_without_prompt(tmp_path, prompt):
    bad = completion("b")
    if prompt == "missing":
        del bad["body"]["prompt"]
    else:
        bad["body"]["prompt"] = prompt
    path = write(tmp_path, [completion("a"), bad])
    assert codes(validate_file(path)) == [("invalid_request", 2, "body.prompt")]


@pytest.mark.parametrize("value", ["missing", None])
def test_embeddings_without_input(tmp_path, value):
    bad = embedding("b")
    if value == "missing":
        del bad["body"]["input"]
    else:
        bad["body"]["input"] = value
    path = write(tmp_path, [embedding("a"), bad])
    assert codes(validate_file(path)) == [("invalid_request", 2, "body.input")]


def test_chat_body_with_prompt_instead_of_messages(tmp_path):
    bad = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": MODEL, "prompt": "hi"}}
    assert codes(validate_file(write(tmp_path, [bad]))) == [("invalid_request", 1, "body.messages")]


# --- method and url -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "post", "PUT"])
def test_invalid_method(tmp_path, method):
    bad = chat("b")
    bad["method"] = method
    path = write(tmp_path, [chat("a"), bad])
    err = only_error(validate_file(path))
    assert (err.code, err.line, err.param) == ("invalid_method", 2, "method")


@pytest.mark.parametrize("url", ["/v1/moderations", "/v1/chat/completions/", "v1/embeddings", "/chat/completions"])
def test_unknown_url(tmp_path, url):
    bad = chat("b")
    bad["url"] = url
    path = write(tmp_path, [chat("a"), bad])
    err = only_error(validate_file(path))
    assert (err.code, err.line, err.param) == ("invalid_url", 2, "url")


def test_url_differs_from_first_lines_url(tmp_path):
    path = write(tmp_path, [chat("a"), completion("b"), chat("c"), embedding("d")])
    report = validate_file(path)
    assert codes(report) == [("invalid_url", 2, "url"), ("invalid_url", 4, "url")]
    assert report.endpoint == CHAT


def test_endpoint_defaults_to_first_line_url_even_when_later_lines_agree(tmp_path):
    path = write(tmp_path, [completion("a"), chat("b"), chat("c")])
    report = validate_file(path)
    assert report.endpoint == COMPLETIONS
    assert codes(report) == [("invalid_url", 2, "url"), ("invalid_url", 3, "url")]


def test_explicit_endpoint_argument(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b")])
    report = validate_file(path, endpoint=COMPLETIONS)
    assert report.endpoint == COMPLETIONS
    assert codes(report) == [("invalid_url", 1, "url"), ("invalid_url", 2, "url")]

    path = write(tmp_path, [completion("a"), completion("b")], name="c.jsonl")
    report = validate_file(path, endpoint=COMPLETIONS)
    assert report.valid
    assert report.endpoint == COMPLETIONS


def test_explicit_unknown_endpoint_is_a_file_level_error(tmp_path):
    path = write(tmp_path, [chat("a")])
    report = validate_file(path, endpoint="/v1/moderations")
    assert not report.valid
    assert report.errors[0].code == "invalid_url"
    assert report.errors[0].line is None
    assert report.errors[0].param == "endpoint"


# --- duplicates, models ---------------------------------------------------------------------


def test_duplicate_custom_id_reported_at_later_occurrence(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b"), "", chat("a"), chat("c"), chat("b"), chat("a")])
    report = validate_file(path)
    assert codes(report) == [
        ("duplicate_custom_id", 4, "custom_id"),
        ("duplicate_custom_id", 6, "custom_id"),
        ("duplicate_custom_id", 7, "custom_id"),
    ]


def test_mixed_models_only_first_differing_line(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b"), chat("c", model="other"), chat("d", model="third"), chat("e", model="other")])
    report = validate_file(path)
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("mixed_models", 3, "body.model")
    assert report.model == MODEL


def test_model_not_found(tmp_path):
    path = write(tmp_path, [chat("a", model="gpt-9"), chat("b", model="gpt-9")])
    report = validate_file(path, models={"smollm2-135m-instruct", "all-minilm-l6-v2"})
    err = only_error(report)
    assert (err.code, err.line, err.param) == ("model_not_found", 1, "body.model")
    assert "gpt-9" in err.message


def test_model_not_found_at_first_valid_line(tmp_path):
    path = write(tmp_path, ["garbage", "", chat("a", model="gpt-9")])
    report = validate_file(path, models=["smollm2-135m-instruct"])
    assert codes(report) == [("invalid_json", 1, None), ("model_not_found", 3, "body.model")]


def test_served_model_passes_models_check(tmp_path):
    path = write(tmp_path, [chat("a"), chat("b")])
    assert validate_file(path, models=["smollm2-135m-instruct"]).valid
    assert not validate_file(path, models=[]).valid


# --- line numbering, BOM, CRLF, many errors -------------------------------------------------


def test_blank_lines_count_toward_line_numbers(tmp_path):
    path = write(tmp_path, ["", chat("a"), "", "   ", "", "{oops", "", chat("a")])
    report = validate_file(path)
    assert codes(report) == [("invalid_json", 6, None), ("duplicate_custom_id", 8, "custom_id")]
    assert report.total_requests == 3


def test_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "bom_crlf.jsonl"
    body = "\r\n".join(json.dumps(chat(x)) for x in "abc") + "\r\n"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    report = validate_file(path)
    assert report.valid, codes(report)
    assert report.total_requests == 3
    assert report.endpoint == CHAT


def test_crlf_line_numbers(tmp_path):
    path = write(tmp_path, [chat("a"), "", "{x", chat("a")], sep="\r\n")
    assert codes(validate_file(path)) == [("invalid_json", 3, None), ("duplicate_custom_id", 4, "custom_id")]


def test_bom_only_stripped_on_first_line(tmp_path):
    path = tmp_path / "bom2.jsonl"
    path.write_bytes(json.dumps(chat("a")).encode() + b"\n\xef\xbb\xbf" + json.dumps(chat("b")).encode() + b"\n")
    # A BOM in the middle of the file is not whitespace JSON accepts.
    assert codes(validate_file(path)) == [("invalid_json", 2, None)]


def test_all_errors_are_reported(tmp_path):
    no_method = chat("m")
    del no_method["method"]
    get = chat("g")
    get["method"] = "GET"
    lines = [
        chat("a"),  # 1 ok
        "{",  # 2 invalid_json
        "[]",  # 3 invalid_request
        no_method,  # 4 invalid_request method
        get,  # 5 invalid_method
        completion("u"),  # 6 invalid_url
        chat("a"),  # 7 duplicate
        chat("o", model="other"),  # 8 mixed
        chat("z"),  # 9 ok
    ]
    report = validate_file(write(tmp_path, lines))
    assert codes(report) == [
        ("invalid_json", 2, None),
        ("invalid_request", 3, None),
        ("invalid_request", 4, "method"),
        ("invalid_method", 5, "method"),
        ("invalid_url", 6, "url"),
        ("duplicate_custom_id", 7, "custom_id"),
        ("mixed_models", 8, "body.model"),
    ]
    assert report.error_count == 7
    assert report.total_requests == 9
    assert all(e.message for e in report.errors)


def test_error_list_capped_but_count_keeps_going(tmp_path):
    path = write(tmp_path, [chat("a")] + ["{bad"] * 25)
    report = validate_file(path, max_errors=10)
    assert len(report.errors) == 10
    assert report.error_count == 25
    assert [e.line for e in report.errors] == list(range(2, 12))
    assert report.to_dict()["error_count"] == 25
    assert not report.valid


def test_default_error_cap_is_max_errors(tmp_path):
    path = write(tmp_path, ["{bad"] * (MAX_ERRORS + 5))
    report = validate_file(path)
    assert len(report.errors) == MAX_ERRORS
    assert report.error_count == MAX_ERRORS + 5


def test_file_level_error_counted_even_when_list_full(tmp_path):
    path = write(tmp_path, ["{bad"] * 5)
    report = validate_file(path, max_errors=2, limits=c.Limits(max_requests=3))
    assert report.error_count == 6
    assert len(report.errors) == 2


# --- on_request -----------------------------------------------------------------------------


def test_on_request_receives_valid_requests_only(tmp_path):
    bad_method = chat("m")
    bad_method["method"] = "GET"
    lines = [chat("a"), "", "{", chat("b"), bad_method, chat("a"), "[]", chat("c")]
    seen = []
    report = validate_file(write(tmp_path, lines), on_request=lambda n, r: seen.append((n, r)))
    assert [(n, r["custom_id"]) for n, r in seen] == [(1, "a"), (4, "b"), (8, "c")]
    assert seen[0][1] == chat("a")
    assert not report.valid


def test_on_request_not_called_for_the_mixed_models_line(tmp_path):
    lines = [chat("a"), chat("b", model="other"), chat("c")]
    seen = []
    validate_file(write(tmp_path, lines), on_request=lambda n, r: seen.append(n))
    assert seen == [1, 3]


def test_on_request_with_bom_and_crlf(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(chat("a")) + "\r\n\r\n" + json.dumps(chat("b")) + "\r\n").encode())
    seen = []
    assert validate_file(path, on_request=lambda n, r: seen.append((n, r["custom_id"]))).valid
    assert seen == [(1, "a"), (3, "b")]


def test_on_request_stops_past_max_requests(tmp_path):
    path = write(tmp_path, [chat(f"r{i}") for i in range(5)])
    seen = []
    report = validate_file(path, limits=c.Limits(max_requests=3), on_request=lambda n, r: seen.append(n))
    assert seen == [1, 2, 3]
    assert codes(report) == [("too_many_requests", None, None)]


# --- streaming ------------------------------------------------------------------------------


class _TrackingReader(io.RawIOBase):
    """A raw binary stream that knows how far it has been read."""

    def __init__(self, data: bytes):
        self._buf = io.BytesIO(data)

    @property
    def consumed(self) -> int:
        return self._buf.tell()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._buf.readinto(b)


def test_streams_a_large_file(tmp_path):
    n = 20_000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(chat(f"req-{i}")) + "\n")
            if i % 1000 == 999:
                f.write("\n")
    seen_ids = []
    last_line = [0]

    def on_request(line_no, request):
        assert line_no > last_line[0]
        last_line[0] = line_no
        seen_ids.append(request["custom_id"])

    report = validate_file(path, on_request=on_request)
    assert report.valid, codes(report)[:5]
    assert report.total_requests == n
    assert seen_ids == [f"req-{i}" for i in range(n)]
    # 20 blank lines were interleaved; the last request is on physical line n + 19.
    assert last_line[0] == n + 19


def test_validate_stream_does_not_read_ahead_of_the_request_it_reports():
    # When request i is handed over, the stream must not have been read much past line i:
    # the validator streams instead of loading the whole file first.
    n = 5_000
    lines = [json.dumps(chat(f"q{i}")).encode() + b"\n" for i in range(n)]
    ends, pos = [], 0
    for line in lines:
        pos += len(line)
        ends.append(pos)
    data = b"".join(lines)
    buffer_size = 16 * 1024
    raw = _TrackingReader(data)
    reader = io.BufferedReader(raw, buffer_size=buffer_size)
    lead = []

    def on_request(line_no, request):
        lead.append(raw.consumed - ends[line_no - 1])

    report = validate_stream(reader, on_request=on_request)
    assert report.valid
    assert len(lead) == n
    assert len(data) > 50 * buffer_size
    assert max(lead) <= buffer_size


def test_model_that_does_not_serve_the_endpoint_is_an_invalid_url(tmp_path):
    from batch_dagster.batchfile.validate import validate_file

    path = tmp_path / "emb.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "chat", "input": "hi"}}) + "\n")
    served = {"chat": ("/v1/chat/completions", "/v1/completions"), "emb": ("/v1/embeddings",)}
    report = validate_file(path, models=served)
    assert [(e.code, e.line, e.param) for e in report.errors] == [("invalid_url", 1, "url")]
    assert "does not serve /v1/embeddings" in report.errors[0].message
    assert validate_file(path, models=set(served)).valid  # names only: no endpoint check


def test_model_of_head_reads_the_first_request_before_validation():
    line = (json.dumps(chat("a")) + "\n").encode()
    assert c.model_of_head(b"\xef\xbb\xbf\n" + line + line[:10]) == MODEL
    assert c.model_of_head(line[:-1]) is None  # cut off: the file may go on
    assert c.model_of_head(line[:-1], whole=True) == MODEL  # the whole file, with no final newline
    for head in (b"[1, 2]\n", b"{oops\n", b'{"body": "x"}\n', b'{"body": {"model": 7}}\n', b""):
        assert c.model_of_head(head, whole=True) is None, head
