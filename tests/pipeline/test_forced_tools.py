"""Which of the installed vLLM's tool-call parsers make a forced tool call follow the tool's parameters, derived from
vLLM's own classes and structural tags, against the registry's table of those that cannot (whose models validation
refuses forced tool choice): when vLLM changes a parser, this says which way."""

from __future__ import annotations

from typing import Any

from batch_dagster.batchfile.registry import UNCONSTRAINED_TOOL_PARSERS
from batch_dagster.engine.flags import TOOL_STRICT_LEVEL

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
              "required": ["city", "days"]}


def _schemas(node: Any, found: list[Any]) -> list[Any]:
    """Every JSON schema a structural tag holds (its JSONSchemaFormat parts)."""
    from pydantic import BaseModel
    from xgrammar.structural_tag import JSONSchemaFormat

    if isinstance(node, JSONSchemaFormat):
        found.append(node.json_schema)
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            _schemas(getattr(node, name), found)
    elif isinstance(node, (list, tuple)):
        for item in node:
            _schemas(item, found)
    return found


def _forced_arguments(parser: type, choice: Any, tool: Any) -> str:
    """How a forced call's arguments are bound with `parser` at the registry's strict level: "schema" (a JSON schema
    of the tool's parameters, whole or per argument) or "free" (no grammar reaches them)."""
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    if parser.supports_required_and_named:  # vLLM's JSON schema over the calls: the parameters, whole
        return "schema"
    if parser.structural_tag_model is None:  # a forced choice runs as `auto`
        return "free"
    tag = get_model_structural_tag(parser.structural_tag_model, [tool], choice, reasoning=False,
                                   strict_level=ToolStrictLevel.from_name(TOOL_STRICT_LEVEL))
    schemas = _schemas(tag, [])
    pinned = PARAMETERS in schemas or any(s in schemas for s in PARAMETERS["properties"].values())
    return "schema" if pinned else "free"


def test_the_registry_refuses_forced_tool_choice_exactly_where_vllms_parser_leaves_the_arguments_free():
    from vllm import envs
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers import ToolParserManager

    assert envs.VLLM_ENFORCE_STRICT_TOOL_CALLING  # vLLM's default: structural tags on (the table assumes it)
    tool = ChatCompletionToolsParam.model_validate({"type": "function", "function": {"name": "f",
                                                                                      "parameters": PARAMETERS}})
    named = ChatCompletionNamedToolChoiceParam.model_validate({"type": "function", "function": {"name": "f"}})
    free = {}
    for name in sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)):
        parser = ToolParserManager.get_tool_parser(name)
        kinds = {_forced_arguments(parser, choice, tool) for choice in ("required", named)}
        if "free" in kinds:
            free[name] = kinds
    assert set(free) == set(UNCONSTRAINED_TOOL_PARSERS), free
    assert "hermes" not in free  # the embedded model's parser
