"""The docs' examples that only a framework can read, for the docs test (tests/core/doc_examples.py), which runs this
in a process of its own so that the core tier loads no framework: a component's defs.yaml through the component's
own model, a workspace.yaml through Dagster's schema, a `dg` command through dg's own command line, and a typed
object through the pydantic model that reads it (the API's, or the openai SDK's a client reads it with); and the
fields of the API's objects, which the docs must list.

    python -m tests.doc_frameworks < checks.json    # [[kind, payload], ...] -> a problem (or null) for each
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import shlex
import sys
from typing import Any


def component(text: str) -> str | None:
    """A defs.yaml: its `type` is a component, and its `attributes` resolve through that component's model."""
    import dagster as dg
    import yaml

    data = yaml.safe_load(text)
    module, _, name = data["type"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return f"type {data['type']!r}: no such component"
    if not (isinstance(cls, type) and issubclass(cls, dg.Component)):
        return f"type {data['type']!r} is not a Dagster component"
    try:
        built = cls.resolve_from_yaml(yaml.safe_dump(data.get("attributes") or {}))
        if check := getattr(built, "table_batch", None):  # what build_defs checks before it builds the asset
            from batch_dagster.batchfile.table import check_key_columns

            check()
            check_key_columns(built.request, built.key_columns)
    except Exception as exc:  # the component's model and resolvers raise pydantic's, Dagster's or their own
        return f"{data['type']} refuses its attributes: {last_line(exc)}"
    return None


def last_line(exc: BaseException) -> str:
    """The cause a user reads: the innermost exception's message, on one line."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " ".join(str(exc).split())[:500]


def workspace(data: dict[str, Any]) -> str | None:
    # Dagster's own schema of workspace.yaml; a private module (dagster 1.13), read by a test only.
    from dagster._config import validate_config
    from dagster._core.workspace.config_schema import WORKSPACE_CONFIG_SCHEMA

    result = validate_config(WORKSPACE_CONFIG_SCHEMA, data)
    return None if result.success else "; ".join(e.message for e in result.errors)


def dg_command(line: str) -> str | None:
    """`dg WORDS` parsed by dg's own command line with --help added, so it parses its options and runs nothing."""
    import click
    from dagster_dg_cli.cli import cli

    words = shlex.split(line)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            cli.main([*words, "--help"], prog_name="dg", standalone_mode=False)
    except click.ClickException as exc:
        return f"`dg {line}`: {exc.format_message()}"
    return None


def model(payload: dict[str, Any]) -> str | None:
    """An object read by its pydantic model (`module:Name`); with `exact`, every key shown must be a field of it. An
    object whose block elides members is checked for those it shows (a missing field is no error)."""
    import pydantic

    module, _, name = payload["model"].partition(":")
    adapter = pydantic.TypeAdapter(getattr(importlib.import_module(module), name))
    data, problems = payload["data"], []
    try:
        adapter.validate_python(data)
    except pydantic.ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
                    if not (payload["elided"] and e["type"] == "missing")]
    if payload.get("exact"):
        schema = adapter.json_schema()
        problems += [f"no field {key}" for key in unknown_keys(data, schema, schema.get("$defs", {}))]
    return f"{name} refuses it: " + "; ".join(problems[:5]) if problems else None


def unknown_keys(shown: Any, schema: dict[str, Any], defs: dict[str, Any], at: str = "") -> list[str]:
    """The keys of `shown` that its JSON schema has no property for (a union: none of its members)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        found = [unknown_keys(shown, option, defs, at) for option in options if option.get("type") != "null"]
        return min(found, key=len) if found else []
    out = []
    if isinstance(shown, dict) and "properties" in schema:
        for key, value in shown.items():
            if key not in schema["properties"]:
                out.append(at + key)
            else:
                out += unknown_keys(value, schema["properties"][key], defs, f"{at}{key}.")
    elif isinstance(shown, list) and "items" in schema:
        for item in shown:
            out += unknown_keys(item, schema["items"], defs, at)
    return out


def field_names(name: str) -> list[str]:
    """A pydantic model's fields (`module:Name`), as the docs that list them must name them."""
    module, _, cls = name.partition(":")
    return list(getattr(importlib.import_module(module), cls).model_fields)


CHECKS = {"component": component, "workspace": workspace, "dg": dg_command, "model": model, "fields": field_names}


def main() -> None:
    print(json.dumps([CHECKS[kind](payload) for kind, payload in json.load(sys.stdin)]))


if __name__ == "__main__":
    main()
