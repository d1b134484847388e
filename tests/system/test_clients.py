"""Clients with a batch mode, unchanged, against `python -m batch_dagster.serve` on the real engine: the official
`openai` SDK's async client, inspect_ai's `--batch` over chat completions and over the Responses API, instructor's
BatchProcessor and litellm's files and batches calls. Each is pointed at the service the way its users do it
(OPENAI_BASE_URL and OPENAI_API_KEY; docs/http-api.md), and every answer it reads back is checked.

One serve for the module, its model on the session's vLLM server (a warm fleet of one): the clients' batches are
small, so the time is the clients' polling and the pipeline's fixed cost, not the engine's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import CHAT_MODEL, CONCISE, SERVE_API_KEY, Serve, answer_text, file_lines, write_jsonl

pytestmark = pytest.mark.engine

TERMINAL = {"completed", "failed", "expired", "cancelled"}
CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Germany": "Berlin", "Spain": "Madrid"}
# Every character str.splitlines() breaks at and JSON writers may leave raw, in a text the model is made to write.
BREAKS_TEXT = "one\u2028two\u2029three\u0085four"


@pytest.fixture(scope="module")
def serve(tmp_path_factory, vllm_server):
    """serve with the chat model on the session's vLLM server; the clients' environment points at it."""
    tmp = tmp_path_factory.mktemp("clients")
    with Serve(tmp, BATCH_FLEET_URLS=f"{CHAT_MODEL}={vllm_server}") as running, pytest.MonkeyPatch.context() as env:
        env.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{running.api_port}/v1")
        env.setenv("OPENAI_API_KEY", SERVE_API_KEY)
        env.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches its price list at import otherwise
        yield running


def question(country: str) -> list[dict]:
    return [{"role": "system", "content": CONCISE}, {"role": "user", "content": f"What is the capital of {country}?"}]


# -- the openai SDK's async client -----------------------------------------------------------------------------------

def test_the_openai_async_client_runs_a_batch_and_reads_every_line_with_splitlines(serve, tmp_path):
    from openai import AsyncOpenAI

    rows = [{"custom_id": country, "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": CHAT_MODEL, "messages": question(country), "max_tokens": 16,
                      "temperature": 0}} for country in CAPITALS]
    # The model made to write the line separators (vLLM's structured outputs: the one choice it may write).
    rows.append({"custom_id": "separators", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Say something."}],
                          "structured_outputs": {"choice": [BREAKS_TEXT]}, "max_tokens": 24, "temperature": 0}})
    path = write_jsonl(tmp_path / "capitals.jsonl", rows)

    async def run() -> tuple[object, str, str]:
        client = AsyncOpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY
        with open(path, "rb") as f:
            upload = await client.files.create(file=f, purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"client": "openai-async"})
        for _ in range(480):
            if batch.status in TERMINAL:
                break
            await asyncio.sleep(0.5)
            batch = await client.batches.retrieve(batch.id)
        output = await client.files.content(batch.output_file_id) if batch.output_file_id else None
        errors = await client.files.content(batch.error_file_id) if batch.error_file_id else None
        return batch, output.text if output else "", errors.text if errors else ""

    batch, output, errors = asyncio.run(run())
    assert batch.status == "completed", (batch, serve.logs())
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}, errors
    lines = [json.loads(line) for line in output.splitlines()]  # as a reader that splits with splitlines() does
    answers = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in lines}
    assert sorted(answers) == sorted([*CAPITALS, "separators"])
    assert answers["separators"] == BREAKS_TEXT  # written raw by the model, escaped in the file, read back whole
    assert "Paris" in answers["France"] and sum(city in answers[c] for c, city in CAPITALS.items()) >= 3, answers
    assert errors == ""


# -- inspect_ai --------------------------------------------------------------------------------------------------------

TASK = """\
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, system_message

CAPITALS = {capitals!r}


@task
def capitals():
    return Task(dataset=[Sample(input=f"What is the capital of {{c}}?", target=city, id=c)
                         for c, city in CAPITALS.items()],
                solver=[system_message({concise!r}), generate()], scorer=includes())
"""


def inspect_eval(serve: Serve, folder: Path, *model_args: str) -> dict:
    """`inspect eval capitals.py --batch batch.yaml` in `folder` (a task path must be relative), as a user runs it:
    the eval's log, read with inspect's own reader."""
    from inspect_ai.log import read_eval_log

    folder.mkdir()
    (folder / "capitals.py").write_text(TASK.format(capitals=CAPITALS, concise=CONCISE))
    # Small batches, polled every second (inspect's defaults wait 15 s to fill a batch of 100, and poll every 15 s).
    (folder / "batch.yaml").write_text("size: 5\nsend_delay: 1\ntick: 1\n")
    command = [str(Path(sys.executable).with_name("inspect")), "eval", "capitals.py",
               "--model", f"openai/{CHAT_MODEL}", "--batch", "batch.yaml", "--temperature", "0", "--max-tokens", "24",
               "--log-dir", "logs", "--log-format", "json", "--display", "plain", "--max-retries", "0",
               # inspect takes a model it does not know at a custom base URL for a reasoning one, and unless told
               # the summary it wants, it first asks an interactive Responses call with no token bound: the 135M
               # model wrote up to its context, 10 to 90 s. The batch lines still ask what main refused (below).
               "--reasoning-summary", "none"]
    for arg in model_args:
        command += ["-M", arg]
    done = subprocess.run(command, cwd=folder, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:], serve.logs())
    [log_file] = (folder / "logs").glob("*.json")
    log = read_eval_log(str(log_file))
    assert log.status == "success", (log.error, done.stdout[-3000:], serve.logs())
    return {str(s.id): s for s in log.samples or []}


def text(content: str | list[dict]) -> str:
    """A request message's text: a string, or its parts' texts (chat's and Responses' input parts)."""
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def taken(serve: Serve, endpoint: str) -> list[tuple[dict, str | None]]:
    """Each line of the batches the service took on `endpoint`, newest batch first, as the client sent it, with the
    answer the service wrote for it (None for none)."""
    client = serve.client()
    lines = []
    for batch in client.batches.list(limit=100):
        if batch.endpoint != endpoint:
            continue
        said = {row["custom_id"]: answer_text(row["response"]["body"])
                for row in file_lines(client, batch.output_file_id)} if batch.output_file_id else {}
        sent = client.files.content(batch.input_file_id).text  # a client's own file, split at its newlines only
        lines += [(row, said.get(row["custom_id"])) for row in map(json.loads, filter(str.strip, sent.split("\n")))]
    return lines


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_inspect_ai_batch_mode_answers_every_sample(serve, tmp_path, api):
    samples = inspect_eval(serve, tmp_path / api, f"responses_api={'true' if api == 'responses' else 'false'}")
    assert sorted(samples) == sorted(CAPITALS)
    for country, sample in samples.items():
        assert sample.error is None, (country, sample.error)
        assert sample.output.completion.strip(), country  # an answer read back from the batch's output file
    endpoint = "/v1/responses" if api == "responses" else "/v1/chat/completions"
    lines = taken(serve, endpoint)
    sent = [row["body"] for row, _ in lines if "capital of" in json.dumps(row["body"])]
    assert len(sent) >= len(CAPITALS)
    # Each sample read back the answer the service wrote for its own question (in the newest batch asking it).
    answers = {c: s.output.completion for c, s in samples.items()}
    said: dict[str, str | None] = {}
    for row, written in lines:
        said.setdefault(text((row["body"].get("messages") or row["body"]["input"])[-1]["content"]), written)
    assert {c: (said[f"What is the capital of {c}?"] or "").strip() for c in CAPITALS} == {
        c: a.strip() for c, a in answers.items()}, (answers, said)
    # inspect takes a model name it does not know for OpenAI's newest, and on chat lines leaves the temperature out
    # ("temperature is always 1", it warns): those answers are sampled. Where the lines ask for greedy ones, the
    # 135M model knows most capitals.
    if all(b.get("temperature") == 0 for b in sent):
        assert "Paris" in answers["France"], (answers, sent[:1])
        assert sum(s.scores["includes"].value == "C" for s in samples.values()) >= 3, answers
    if api == "responses":  # what main refused at validation, failing the whole eval
        assert all(b.get("include") == ["reasoning.encrypted_content"] and b.get("store") is False for b in sent)


# -- instructor ----------------------------------------------------------------------------------------------------------

def test_instructor_batch_processor_parses_every_answer_into_the_model(serve, tmp_path):
    from instructor.batch import BatchProcessor
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        city: str

    processor = BatchProcessor(f"openai/{CHAT_MODEL}", Capital)
    messages = [[{"role": "system", "content": "Answer with the country and its capital."},
                 {"role": "user", "content": f"What is the capital of {country}?"}] for country in CAPITALS]
    # A file path, as instructor's docs write it: its in-memory buffer is uploaded without a .jsonl name, which
    # OpenAI's Batch API refuses too ("Invalid file format for Batch API. Must be .jsonl").
    path = processor.create_batch_from_messages(messages, file_path=str(tmp_path / "instructor.jsonl"),
                                                max_tokens=80, temperature=0.0)
    first = json.loads(Path(path).read_text().splitlines()[0])
    assert first["body"]["response_format"]["type"] == "json_schema"  # strict json_schema lines
    batch_id = processor.submit_batch(path)
    for _ in range(480):
        status = processor.get_batch_status(batch_id)
        if status["status"] in TERMINAL:
            break
        time.sleep(0.5)
    assert status["status"] == "completed", (status, serve.logs())
    results = processor.retrieve_results(batch_id)
    assert len(results) == len(CAPITALS)
    parsed = {r.custom_id: r.result for r in results if r.success}
    assert len(parsed) == len(CAPITALS), [r for r in results if not r.success]
    for value in parsed.values():
        assert isinstance(value, Capital) and value.country and value.city
    assert any(v.city == "Paris" for v in parsed.values()), parsed


# -- litellm --------------------------------------------------------------------------------------------------------------

def test_litellm_files_and_batches_calls_run_a_batch(serve, tmp_path):
    import litellm

    rows = [{"custom_id": country, "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": CHAT_MODEL, "messages": question(country), "max_tokens": 16,
                      "temperature": 0}} for country in CAPITALS]
    path = write_jsonl(tmp_path / "litellm.jsonl", rows)

    async def run():
        with open(path, "rb") as f:
            upload = await litellm.acreate_file(file=f, purpose="batch", custom_llm_provider="openai")
        batch = await litellm.acreate_batch(completion_window="24h", endpoint="/v1/chat/completions",
                                            input_file_id=upload.id, custom_llm_provider="openai")
        for _ in range(480):
            if batch.status in TERMINAL:
                break
            await asyncio.sleep(0.5)
            batch = await litellm.aretrieve_batch(batch_id=batch.id, custom_llm_provider="openai")
        content = await litellm.afile_content(file_id=batch.output_file_id, custom_llm_provider="openai")
        return batch, content.text

    batch, output = asyncio.run(run())
    assert batch.status == "completed", (batch, serve.logs())
    assert batch.request_counts.completed == len(CAPITALS) and batch.request_counts.failed == 0
    answers = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
               for x in map(json.loads, output.splitlines())}
    assert sorted(answers) == sorted(CAPITALS) and "Paris" in answers["France"], answers
