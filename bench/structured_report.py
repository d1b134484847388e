"""The structured workload's report (BENCH_WORKLOAD=structured): per stage and mode, the share of answers that follow
their schema and the share the pipeline flagged (its lines' `invalid_structured` mark).

Whether an answer follows is decided here, with jsonschema directly, not by the pipeline's own check: "every invalid
answer flagged" is then measured (`missed`: invalid and not flagged; `false_flags`: flagged and valid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
from jsonschema import Draft202012Validator

from bench.workload import structured_mode

MARK = "invalid_structured"


def _json(text: Any) -> Any:
    return json.loads(text) if isinstance(text, str) else None


def _valid(value: Any, schema: Any) -> bool:
    return not any(Draft202012Validator(schema).iter_errors(value))


def follows(request: dict[str, Any], body: dict[str, Any]) -> bool:
    """Whether a chat answer is what its request asked: a forced call of its tools with arguments following their
    parameters, or content following its response format."""
    message = body["choices"][0]["message"]
    choice = request.get("tool_choice")
    try:
        if choice == "required" or isinstance(choice, dict):
            tools = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                     for t in request["tools"]}
            if isinstance(choice, dict):
                tools = {choice["function"]["name"]: tools[choice["function"]["name"]]}
            calls = message.get("tool_calls") or []
            single = request.get("parallel_tool_calls") is False
            return bool(calls) and not (single and len(calls) > 1) and all(
                call["function"]["name"] in tools and isinstance(args := _json(call["function"]["arguments"]), dict)
                and _valid(args, tools[call["function"]["name"]]) for call in calls)
        fmt = request["response_format"]
        value = _json(message.get("content"))
        if fmt["type"] == "json_object":
            return isinstance(value, dict)
        return _valid(value, fmt["json_schema"]["schema"])
    except json.JSONDecodeError:
        return False


def _empty() -> dict[str, int]:
    return {"requests": 0, "answered": 0, "valid": 0, "cut": 0, "flagged": 0, "missed": 0, "false_flags": 0}


def report(input_path: Path, outputs: dict[str, Path]) -> dict[str, Any]:
    """{stage: {mode: counts and shares}} for each stage's output file (run_batch's holds its failures too)."""
    with open(input_path, "rb") as f:
        requests = {line["custom_id"]: line["body"] for line in map(orjson.loads, f)}
    out: dict[str, Any] = {}
    for stage, path in outputs.items():
        modes: dict[str, dict[str, Any]] = {}
        with open(path, "rb") as f:
            for line in map(orjson.loads, f):
                m = modes.setdefault(structured_mode(line["custom_id"]), _empty())
                m["requests"] += 1
                response = line.get("response") or {}
                if response.get("status_code") != 200:
                    continue
                body, flagged = response["body"], bool(line.get(MARK))
                ok = follows(requests[line["custom_id"]], body)
                m["answered"] += 1
                m["valid"] += ok
                m["cut"] += body["choices"][0]["finish_reason"] == "length"
                m["flagged"] += flagged
                m["missed"] += not ok and not flagged
                m["false_flags"] += ok and flagged
        for m in modes.values():
            m["valid_share"] = round(m["valid"] / m["answered"], 4) if m["answered"] else None
            m["flagged_share"] = round(m["flagged"] / m["answered"], 4) if m["answered"] else None
        out[stage] = dict(sorted(modes.items()))
    return out


def markdown(structured: dict[str, Any]) -> str:
    """One table: a row per stage and mode."""
    head = ["stage", "mode", "answered", "valid", "cut", "flagged", "invalid not flagged"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage, modes in structured.items():
        for mode, m in modes.items():
            share = f"{m['valid']}/{m['answered']} ({m['valid_share']:.0%})" if m["answered"] else "-"
            flagged = m["flagged"] if stage == "pipeline" else "-"
            missed = m["missed"] if stage == "pipeline" else "-"
            rows.append(f"| {stage} | {mode} | {m['answered']}/{m['requests']} | {share} | {m['cut']} | {flagged} | "
                        f"{missed} |")
    return "\n".join(rows)
