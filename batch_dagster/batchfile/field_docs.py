"""docs/formats.md's field tables, generated from the field matrix (fields.py) and the body schema (schema.py).

    python -m batch_dagster.batchfile.field_docs --update docs/formats.md
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import contract as c
from . import generated
from .fields import FIELDS, HONORED, NO_EFFECT, PARTS, REFUSED, Field
from .schema import PROMPT, SCHEMAS

BEGIN, END = "<!-- BEGIN GENERATED: fields -->", "<!-- END GENERATED: fields -->"
_NAMES = {c.CHAT: "Chat completions", c.COMPLETIONS: "Completions", c.EMBEDDINGS: "Embeddings",
          c.RESPONSES: "Responses", c.SCORE: "Score", c.RERANK: "Rerank", c.MESSAGES: "Messages (Anthropic)"}


def _num(v: float) -> str:
    return str(int(v)) if v == int(v) else f"{v:g}"


def _bounds(t: Any) -> str:
    low = f">= {_num(t.ge)}" if t.ge is not None else f"> {_num(t.gt)}" if t.gt is not None else ""
    high = f"<= {_num(t.le)}" if t.le is not None else f"< {_num(t.lt)}" if t.lt is not None else ""
    if t.ge is not None and t.le is not None:
        return f" {_num(t.ge)} to {_num(t.le)}"
    return " " + " and ".join(b for b in (low, high) if b) if low or high else ""


def type_text(t: Any) -> str:
    """A msgspec type as a reader of the API reference says it: `integer 1 to 128`, `array of string`."""
    i = msgspec.inspect
    if isinstance(t, i.UnionType):
        kinds = [type_text(x) for x in t.types if not isinstance(x, i.NoneType)]
        return " or ".join(dict.fromkeys(kinds))
    if isinstance(t, i.IntType):
        return "integer" + _bounds(t)
    if isinstance(t, i.FloatType):
        return "number" + _bounds(t)
    if isinstance(t, i.BoolType):
        return "boolean"
    if isinstance(t, i.StrType):
        return "string"
    if isinstance(t, i.LiteralType):
        return ", ".join(f"`{v}`" for v in t.values)
    if isinstance(t, i.ListType):
        return f"array of {type_text(t.item_type)}"
    if isinstance(t, i.DictType):
        return "object" if isinstance(t.value_type, i.AnyType) else f"object of {type_text(t.value_type)}"
    if isinstance(t, i.StructType):
        tag = f" (`{t.tag_field}`: `{t.tag}`)" if t.tag is not None else ""
        return f"object{tag}"
    return "any"


def _field_types(url: str) -> dict[str, str]:
    info = msgspec.inspect.type_info(SCHEMAS[url])
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: type_text(f.type) for f in info.fields}


_KINDS = (HONORED, NO_EFFECT, REFUSED)


def _row(name: str, field: Field, kind: str) -> str:
    if field.kind == REFUSED:
        return f"| `{name}` | refused | | {field.note} |"
    when = f"; refused {field.when}" if field.when else ""
    return f"| `{name}` | {field.kind} | {kind} | {field.note}{when} |"


def heading(url: str) -> str:
    """An endpoint's table heading, with how many fields of each kind it has."""
    table = FIELDS[url]
    n = {k: sum(f.kind == k for f in table.values()) for k in _KINDS}
    return (f"#### {_NAMES[url]} (`{url}`): {n[HONORED]} honored, {n[NO_EFFECT]} accepted with no effect here, "
            f"{n[REFUSED]} refused")


def markdown() -> str:
    """One table per endpoint (honored fields first, then the accepted no-ops, then the refused), and the content
    parts'."""
    out: list[str] = []
    for url, table in FIELDS.items():
        types = _field_types(url)
        out += [heading(url), "", "| field | | type and range | what it does, or why it does nothing or is refused |",
                "|---|---|---|---|"]
        for kind in _KINDS:
            for name in sorted(n for n, f in table.items() if f.kind == kind):
                out.append(_row(name, table[name], "see the text" if name == PROMPT[url] else types.get(name, "")))
        out.append("")
    out += ["#### Content parts (chat `messages[].content`, responses `input[].content`)", "",
            "| part `type` | | what it is, or why it is refused |", "|---|---|---|"]
    for kind, part in PARTS.items():
        when = f"; refused {part.when}" if part.when else ""
        out.append(f"| `{kind}` | {part.kind} | {part.note}{when} |")
    return "\n".join(out).rstrip() + "\n"


def with_tables(doc: str) -> str:
    """`doc` with the text between its BEGIN and END markers replaced by `markdown()`."""
    return generated.between(doc, BEGIN, END, markdown())


if __name__ == "__main__":
    generated.main(markdown, with_tables,
                   "python -m batch_dagster.batchfile.field_docs --markdown | --update docs/formats.md")
