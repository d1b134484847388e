"""The `batch-dagster validate` command as a user runs it: exit codes, messages and --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).with_name("batch-dagster"))


# Built here, not taken from tests/helpers.py: the core tier loads no Dagster (see tests/core/test_tiers.py).
def chat_request(custom_id: str, content: str) -> dict:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": content}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def validate(*args):
    return subprocess.run([CLI, "validate", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_valid_file_exits_0_with_json_summary(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", [chat_request("a", "hi"), chat_request("b", "there")])
    proc = validate(path, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report == {"valid": True, "total_requests": 2, "model": "smollm2-135m-instruct",
                      "endpoint": "/v1/chat/completions", "error_count": 0, "errors": []}


def test_invalid_file_exits_1_and_names_line_and_field(tmp_path):
    rows = [chat_request("a", "hi"), "", {"custom_id": "b", "method": "GET", "url": "/v1/chat/completions",
                                          "body": {"model": "smollm2-135m-instruct", "messages": []}}, "[1, 2]"]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    proc = validate(path, "--json")
    assert proc.returncode == 1
    errors = json.loads(proc.stdout)["errors"]
    assert [(e["code"], e["line"], e["param"]) for e in errors] == [
        ("invalid_method", 3, "method"), ("invalid_request", 4, None)]
    human = validate(path)
    assert human.returncode == 1 and "line 3 (method): [invalid_method]" in human.stderr
    assert "Traceback" not in human.stderr


def test_limits_and_endpoint_flags(tmp_path):
    path = write_jsonl(tmp_path / "three.jsonl", [chat_request(str(i), "hi") for i in range(3)])
    too_many = json.loads(validate(path, "--max-requests", 2, "--json").stdout)
    assert [e["code"] for e in too_many["errors"]] == ["too_many_requests"]
    too_big = json.loads(validate(path, "--max-bytes", 100, "--json").stdout)
    assert [e["code"] for e in too_big["errors"]] == ["file_too_large"]
    other = json.loads(validate(path, "--endpoint", "/v1/embeddings", "--json").stdout)
    assert {(e["code"], e["line"]) for e in other["errors"]} == {("invalid_url", 1), ("invalid_url", 2), ("invalid_url", 3)}


def test_missing_file_is_a_clear_error(tmp_path):
    proc = validate(tmp_path / "nope.jsonl")
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and "Traceback" not in proc.stderr


def test_the_run_summary_names_the_engine_and_its_start(capsys):
    from batch_dagster.batchfile.contract import RequestCounts
    from batch_dagster.batchfile.outcome import BatchOutcome, EngineRun, RunOutcome
    from batch_dagster.batchfile.usage import Cost, Usage
    from batch_dagster.cli import _print_summary
    from batch_dagster.settings import Settings

    def printed(engine: EngineRun) -> list[str]:
        batch = BatchOutcome("batch_1", "completed", "/v1/chat/completions", "m", RequestCounts(2, 2, 0),
                             Usage(input_tokens=4, output_tokens=6), Cost("m", 0.0, 0.0, 0.5, "USD"),
                             inference_s=3.0, output_tokens_per_s=2.0, engine=engine)
        _print_summary(RunOutcome(batch, "run-1", "out.jsonl", "err.jsonl", 31.0), Settings.from_env())
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("  engine:")]

    assert printed(EngineRun("offline", None, 27.34)) == ["  engine:   offline vLLM in this process, started in 27.3 s"]
    assert printed(EngineRun("offline", None, 0.0)) == [
        "  engine:   offline vLLM in this process, already running (no engine start)"]
    assert printed(EngineRun("server", "http://127.0.0.1:8200", 0.0)) == [
        "  engine:   the vLLM server(s) at http://127.0.0.1:8200 (no engine start)"]


def test_a_model_without_a_price_says_so_beside_its_cost(capsys, monkeypatch, tmp_path):
    from batch_dagster.batchfile.contract import RequestCounts
    from batch_dagster.batchfile.outcome import BatchOutcome, RunOutcome
    from batch_dagster.batchfile.usage import Cost, Usage
    from batch_dagster.cli import _print_summary
    from batch_dagster.settings import Settings

    monkeypatch.delenv("BATCH_PRICES_FILE", raising=False)  # the shipped table: SmolLM2 priced, nothing else

    def note(model: str) -> list[str]:
        batch = BatchOutcome("batch_1", "completed", "/v1/chat/completions", model, RequestCounts(1, 1, 0),
                             Usage(input_tokens=4, output_tokens=6), Cost(model, 0.0, 0.0, 0.5, "USD"))
        _print_summary(RunOutcome(batch, "run-1", "out.jsonl", "err.jsonl", 1.0), Settings.from_env())
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("  note:")]

    assert note("smollm2-135m-instruct") == []
    [line] = note("my-model")
    assert "'my-model' is not in the price table: priced at its [defaults] (0.0 input, 0.0 output USD" in line
    assert "prices.toml (BATCH_PRICES_FILE)" in line
