"""POST /v1/batches/estimate through the openai SDK: the create body, an estimate back, nothing created; the fake
engine's batches give it a measured throughput. Tokens are counted by a word tokenizer, as the fake engine counts."""

from __future__ import annotations

import json

import openai
import pytest

from batch_dagster.batchfile.folder import BatchFolder, batch_ids
from batch_dagster.cli import main
from tests.helpers import CHAT_MODEL, KEY_B, chat_request, rows, upload, wait_for


def use_store(monkeypatch, database_url: str, storage_url: str) -> None:
    monkeypatch.setenv("BATCH_DATABASE_URL", database_url)
    monkeypatch.setenv("BATCH_STORAGE_URL", storage_url)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def estimate(client: openai.OpenAI, file_id: str, **body) -> dict:
    create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **body}
    return client.post("/batches/estimate", body=create, cast_to=object)


def test_an_estimate_counts_what_the_batch_then_bills_and_learns_its_rate(start_service, tmp_path, monkeypatch,
                                                                          capsys):
    service = start_service(shard_size=2)
    client = service.client()
    requests = rows(5, max_tokens=50)  # "question i word word ...": i + 2 words, far fewer than 50 out
    file_id = upload(client, tmp_path / "in.jsonl", requests)

    first = estimate(client, file_id, metadata={"job": "nightly"})
    assert first["object"] == "batch.estimate" and first["valid"] and first["errors"] == {"object": "list", "data": []}
    assert first["model"] == CHAT_MODEL and first["total_requests"] == 5 and first["refused_requests"] == 0
    assert first["input_tokens"] == sum(i + 2 for i in range(5)) and first["max_output_tokens"] == 5 * 50
    assert first["throughput_batches"] == 0 and first["tokens_per_s"] == service.config.estimate_tokens_per_s
    assert first["queued_ahead"] == 0 and first["cost"]["currency"] == "USD"
    assert client.batches.list().data == [] and batch_ids(service.storage.storage()) == []  # nothing created

    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, "completed")
    assert done.usage.input_tokens == first["input_tokens"]
    summary = BatchFolder(service.storage.storage(), batch.id).summary()
    assert first["cost"]["min"] <= summary.cost.total_cost <= first["cost"]["max"]

    again = estimate(client, file_id)
    assert again["throughput_batches"] == 1
    assert again["tokens_per_s"] == pytest.approx(summary.usage.total_tokens / summary.inference_s, abs=0.1)
    assert again["duration_s"]["min"] == pytest.approx(first["input_tokens"] / again["tokens_per_s"], abs=0.1)

    # `batch-dagster estimate FILE --json` against the same store answers what the API answers.
    use_store(monkeypatch, service.config.database_url, service.config.storage_url)
    code, out, _ = cli(capsys, "estimate", str(tmp_path / "in.jsonl"), "--json")
    assert code == 0 and json.loads(out) == again


def test_an_estimate_is_the_callers_and_checks_what_create_checks(start_service, tmp_path):
    service = start_service(worker=False)
    client, other = service.client(), service.client(KEY_B)
    file_id = upload(client, tmp_path / "in.jsonl", rows(3, max_tokens=4))

    with pytest.raises(openai.NotFoundError) as missing:
        estimate(other, file_id)  # another key's file is not found, as for batches
    assert missing.value.body["code"] == "not_found" and missing.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as bad:
        estimate(client, file_id, endpoint="/v1/nope")
    assert bad.value.body["code"] == "invalid_endpoint"
    with pytest.raises(openai.BadRequestError):
        estimate(client, file_id, completion_window="1h")

    # A batch of the model not finished yet is work queued ahead of this one (whoever owns it).
    queued = other.batches.create(input_file_id=upload(other, tmp_path / "b.jsonl", rows(4, max_tokens=4)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert queued.status == "validating"
    ahead = estimate(client, file_id)
    # Not validated yet (no worker here): its requests are not counted, it is taken as this batch's size.
    assert ahead["queued_ahead"] == 1 and ahead["queued_ahead_requests"] == 0 and ahead["queued_ahead_uncounted"] == 1
    mine = ahead["input_tokens"] + ahead["max_output_tokens"]
    assert ahead["duration_s"]["max"] == pytest.approx(2 * mine / ahead["tokens_per_s"], abs=0.1)

    # An invalid file: validation's report, its errors listed as a batch lists them, no numbers.
    bad_rows = [chat_request("a", "hi"), "{not json", chat_request("a", "again")]
    report = estimate(client, upload(client, tmp_path / "bad.jsonl", bad_rows))
    assert not report["valid"] and report["input_tokens"] is None and report["cost"] is None
    assert [(e["code"], e["line"]) for e in report["errors"]["data"]] == [("invalid_json", 2),
                                                                         ("duplicate_custom_id", 3)]


def test_the_estimate_command_prints_the_ranges_and_exits_1_when_invalid(tmp_path, monkeypatch, capsys):
    use_store(monkeypatch, f"sqlite:///{tmp_path / 'store.db'}", str(tmp_path / "storage"))
    good = tmp_path / "in.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows(3, max_tokens=10)))
    code, out, _ = cli(capsys, "estimate", str(good))
    assert code == 0
    assert out.splitlines()[:2] == [f"valid: 3 requests, model {CHAT_MODEL}, endpoint /v1/chat/completions",
                                    "  tokens:   9 input, at most 30 output"]
    assert "BATCH_ESTIMATE_TOKENS_PER_S default" in out and "0 batch(es) of this model ahead" in out

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(chat_request("a", "hi")) + "\n{oops\n")
    code, out, err = cli(capsys, "estimate", str(bad))
    assert code == 1 and out == "" and "line 2: [invalid_json]" in err
    code, out, _ = cli(capsys, "estimate", str(bad), "--json")
    assert code == 1 and json.loads(out)["valid"] is False and json.loads(out)["input_tokens"] is None
