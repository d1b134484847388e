"""What both engines add around vLLM's OpenAI layer: the checks a stored body passes before it is sent, the body
as vLLM takes it, and the batch line made from vLLM's answer (the envelope, our error codes).

Everything between the body and the answer is vLLM's own serving code, in this process or in a server.
"""

from __future__ import annotations

from typing import Any

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.bodies import BodyError, check_body
from batch_dagster.batchfile.fields import Serves, for_engine

Line = dict[str, Any]


class RequestError(Exception):
    """A request refused before it reaches the engine: becomes a 400 line in the error file."""

    def __init__(self, message: str, *, code: str = c.INVALID_REQUEST, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param

    def line(self, custom_id: str) -> Line:
        return c.request_error_line(custom_id, self.code, str(self), param=self.param)


def check(endpoint: str, body: dict[str, Any], serves: Serves | None = None) -> None:
    """Validation's checks of the body, again: a request validation reported (a mistyped or refused field) is
    stored like any other and ends here, as its own 400 line, before it reaches an engine."""
    try:
        check_body(endpoint, body, serves)
    except BodyError as exc:
        raise RequestError(str(exc), param=exc.param.removeprefix("body.")) from None


def vllm_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body as vLLM's server takes it: the accepted no-ops it would refuse left out (fields.for_engine), and our
    `enable_thinking` switch moved into chat_template_kwargs."""
    body = for_engine(endpoint, body)
    if endpoint != c.CHAT or "enable_thinking" not in body:
        return body
    out = {k: v for k, v in body.items() if k != "enable_thinking"}
    given = body.get("chat_template_kwargs") or {}
    out["chat_template_kwargs"] = {**given, "enable_thinking": body["enable_thinking"]}
    return out


def answer_line(custom_id: str, status: int, payload: Any) -> Line:
    """The batch line of vLLM's answer to one request: its body on a 200, else an error line in the contract's shape."""
    if status == 200:
        return c.success_line(custom_id, payload)
    err = payload.get("error", payload) if isinstance(payload, dict) else {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    message = str(err.get("message") or payload)
    if status >= 500:
        code = c.OUT_OF_MEMORY if is_out_of_memory(message) else c.ENGINE_ERROR
        return c.request_error_line(custom_id, code, message, status_code=status)
    code = c.CONTEXT_LENGTH_EXCEEDED if "maximum context length" in message else c.INVALID_REQUEST
    param = err.get("param")
    # A body the server's schema refuses (422 from FastAPI's validation) is a bad request all the same.
    return c.request_error_line(custom_id, code, message, param=param if isinstance(param, str) else None,
                                status_code=400 if status == 422 else status)


def is_out_of_memory(message: str) -> bool:
    return "out of memory" in message.lower()


def failed_for_memory(line: Line) -> bool:
    """A line of a request that ran out of memory (the engine's answer, not the request's fault)."""
    response = line.get("response") or {}
    error = (response.get("body") or {}).get("error") or {}
    return response.get("status_code", 0) >= 500 and error.get("code") == c.OUT_OF_MEMORY
