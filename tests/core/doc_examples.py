"""The docs' code blocks read by the project's own parsers (the docs test, test_docs.py, runs these): a TOML block
through the registry's or the price table's parser, a YAML block through the component's model, Dagster's workspace
schema or the sidecar's parser, a JSON block through the validator, the output-line contract or the typed object it
shows, a Python block compiled.

A block says what it is by its content. One that is an excerpt on purpose, or shows another program's format, says
so in an HTML comment on the line before its fence, which the test reads: `<!-- partial: why -->` or
`<!-- not ours: what it is -->`; such a block is only parsed. In a JSON block, `…` as a member (`{"a": 1, …}`)
stands for members left out: the block is then checked for the members it shows.

What needs a framework to read it (the component's model, Dagster's workspace schema, `dg`'s command line, the
API's pydantic objects, the openai SDK's types) is handed to tests/doc_frameworks.py, in a process of its own, so
that the core tier loads no framework.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from batch_dagster.batchfile import contract
from batch_dagster.batchfile.registry import load_registry, parse_registry, served
from batch_dagster.batchfile.table import TableSpecError
from batch_dagster.batchfile.table_files import Sidecar
from batch_dagster.batchfile.usage import Price, PriceTable
from batch_dagster.batchfile.validate import MORE_ERRORS, validate_stream

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
MARKER = re.compile(r"^\s*<!--\s*(partial|not ours)\b\s*(?::\s*(.*?))?\s*-->\s*$")
ELIDED = re.compile(r",\s*…(?=\s*[}\]])|(?<=[{\[])\s*…\s*,?")
PRICE_FIELDS = {f.name for f in fields(Price)}
# The validation error codes a `{"code": ...}` line may show: the contract's, and the count of the unlisted ones.
ERROR_CODES = frozenset(v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)
                        and re.fullmatch(r"[a-z_]+", v) and v != contract.REUSED) | {MORE_ERRORS}
# The typed objects a JSON block may show, by its `object`, and the pydantic model that reads each.
SCHEMAS = "batch_dagster.api.schemas"
OBJECTS = {"batch.estimate": f"{SCHEMAS}:BatchEstimate", "batch": f"{SCHEMAS}:Batch", "file": f"{SCHEMAS}:FileObject",
           "webhook_endpoint": f"{SCHEMAS}:WebhookEndpoint"}
# An output line's body, by its `object`: what a client reads it with (the openai SDK's types).
BODIES = {"chat.completion": "openai.types.chat:ChatCompletion", "response": "openai.types.responses:Response",
          "text_completion": "openai.types:Completion", "list": "openai.types:CreateEmbeddingResponse"}


@dataclass(frozen=True)
class Block:
    """A fenced code block: the 1-based line of its opening fence, its language, its text and its marker."""

    line: int
    language: str
    text: str
    marker: str | None  # "partial" or "not ours", from the comment before the fence


@dataclass(frozen=True)
class Needs:
    """A check only a framework can make (tests/doc_frameworks.py): its kind and what it is given."""

    kind: str
    payload: str  # JSON

    @classmethod
    def of(cls, kind: str, payload: Any) -> Needs:
        return cls(kind, json.dumps(payload, sort_keys=True))


def blocks(lines: list[str], fence: re.Pattern[str] = FENCE) -> Iterator[Block]:
    """Each fenced block of a doc's lines (fences that never close are another check's report)."""
    i = 0
    while i < len(lines):
        m = fence.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if (e := fence.match(lines[j]))
                    and e.group(1)[0] == m.group(1)[0] and len(e.group(1)) >= len(m.group(1))
                    and not e.group(2).strip()), len(lines))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        yield Block(i + 1, m.group(2).strip().split(" ")[0].lower(), "\n".join(lines[i + 1:end]),
                    marker.group(1) if marker else None)
        i = end + 1


def check_block(block: Block) -> Iterator[str | Needs]:
    """What is wrong with a block (each a message), and what a framework must check of it."""
    reader = {"toml": toml_block, "yaml": yaml_block, "yml": yaml_block, "json": json_block,
              "python": python_block, "py": python_block}.get(block.language)
    if reader is not None:
        yield from reader(block)


def toml_block(block: Block) -> Iterator[str | Needs]:
    try:
        data = tomllib.loads(block.text)
    except tomllib.TOMLDecodeError as exc:
        yield f"not TOML: {exc}"
        return
    if block.marker:
        return
    if not set(data) <= {"models", "defaults", "windows"}:
        yield (f"a TOML block of tables {sorted(data)}: neither a model registry nor a price table (mark it "
               "`<!-- not ours: ... -->` if it is another program's)")
        return
    try:
        if PRICE_FIELDS & set(keys(data)):
            PriceTable.from_dict(data)
        else:
            parse_registry(data)
    except (ValueError, TypeError) as exc:
        kind = "price table" if PRICE_FIELDS & set(keys(data)) else "model registry"
        yield f"the {kind} parser refuses it: {exc}"


def keys(data: Any) -> Iterator[str]:
    """Every key of nested tables (a dotted name read as tables still shows its fields)."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield k
            yield from keys(v)


def yaml_block(block: Block) -> Iterator[str | Needs]:
    import yaml

    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as exc:
        yield f"not YAML: {' '.join(str(exc).split())}"
        return
    if block.marker:
        return
    if isinstance(data, dict) and {"type", "attributes"} <= set(data):
        yield Needs.of("component", block.text)
    elif isinstance(data, dict) and "load_from" in data:
        yield Needs.of("workspace", data)
    elif isinstance(data, dict) and "model" in data:
        try:
            Sidecar.parse(block.text.encode())
        except TableSpecError as exc:
            yield f"the sidecar parser refuses it: {exc}"
    else:
        yield ("a YAML block that is neither a component's defs.yaml, a workspace.yaml nor a table's sidecar (mark "
               "it `<!-- not ours: ... -->` if it is another program's)")


def python_block(block: Block) -> Iterator[str | Needs]:
    try:
        compile(block.text, "<doc>", "exec")
    except SyntaxError as exc:
        yield f"not Python: {exc.msg} at its line {exc.lineno}"


def json_block(block: Block) -> Iterator[str | Needs]:
    text = ELIDED.sub("", block.text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        yield f"not JSON: {exc}"
        return
    if not block.marker:
        yield from json_object(data, elided=text != block.text, text=text)


def json_object(data: Any, elided: bool, text: str) -> Iterator[str | Needs]:
    """What a JSON object shows, read by what reads it."""
    if not isinstance(data, dict):
        yield "a JSON block that is not an object"
    elif {"custom_id", "method", "url", "body"} <= set(data):
        report = validate_stream(io.BytesIO(text.replace("\n", " ").encode()), models=shipped_models())
        for error in [*report.errors, *report.rejected]:
            yield f"the validator refuses this request line: [{error.code}] {error.message} (param {error.param})"
    elif {"custom_id", "response"} <= set(data):
        yield from output_line(data, elided)
    elif {"code", "message"} <= set(data) and set(data) <= {"code", "message", "line", "param"}:
        if data["code"] not in ERROR_CODES:
            yield f"error code {data['code']!r} is not one of the contract's ({', '.join(sorted(ERROR_CODES))})"
    elif data.get("object") == "event":
        yield Needs.of("model", {"model": "openai.types.webhooks:UnwrapWebhookEvent", "data": data, "elided": elided})
        for name, model in (("request_counts", "BatchRequestCounts"), ("usage", "BatchUsage")):
            if name in data.get("data", {}):
                yield Needs.of("model", {"model": f"{SCHEMAS}:{model}", "data": data["data"][name],
                                         "elided": elided, "exact": True})
    elif data.get("object") in OBJECTS:
        model = OBJECTS[data["object"]] + ("WithSecret" if "signing_secret" in data else "")
        yield Needs.of("model", {"model": model, "data": data, "elided": elided, "exact": True})
    else:
        yield ("a JSON block that is none of a request line, an output or error line, a validation error or an "
               f"object of the API (its keys: {', '.join(sorted(data))}); mark it `<!-- not ours: ... -->` if it "
               "is another program's")


def output_line(data: dict[str, Any], elided: bool) -> Iterator[str | Needs]:
    """An output or error file's line: the contract's envelope, and the body a client reads with the SDK's type."""
    envelope = contract.success_line("x", {})
    if unknown := set(data) - set(envelope) - {contract.REUSED, contract.INVALID_STRUCTURED}:
        yield f"an output line has no key {', '.join(sorted(unknown))} (contract.success_line: {', '.join(envelope)})"
    response = data.get("response")
    if isinstance(response, dict):
        if unknown := set(response) - set(envelope["response"]):
            yield f"an output line's response has no key {', '.join(sorted(unknown))}"
        body = response.get("body") or {}
        if body.get("object") in BODIES:
            yield Needs.of("model", {"model": BODIES[body["object"]], "data": body, "elided": elided})


@cache
def shipped_models() -> dict[str, Any]:
    return served(load_registry(REPO / "batch_dagster" / "config" / "models.toml"))


def run_frameworks(needs: tuple[Needs, ...]) -> dict[Needs, Any]:
    """Each framework check's answer (a problem, None when it holds; a kind `fields`: the names), from
    tests/doc_frameworks.py in a process of its own."""
    if not needs:
        return {}
    out = subprocess.run([sys.executable, "-m", "tests.doc_frameworks"], input=json.dumps(
        [[n.kind, json.loads(n.payload)] for n in needs]), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(needs, json.loads(out.stdout.splitlines()[-1]), strict=True))
