"""POST /v1/batches/estimate through the openai SDK: the create body, an estimate back, nothing created; the fake
engine's batches give it a measured throughput. Tokens are counted by a word tokenizer, as the fake engine counts."""

from __future__ import annotations

import io
import json
import threading

import openai
import pytest

from batch_dagster.api.context import ESTIMATES_QUEUED_PER_KEY
from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.folder import BatchFolder, batch_ids
from batch_dagster.batchfile.usage import Price, PriceTable
from batch_dagster.batchfile.validate import MAX_ERRORS, MORE_ERRORS
from batch_dagster.batchfile.windows import Window
from batch_dagster.cli import main
from batch_dagster.engine.models import Models
from batch_dagster.features.estimate import Estimate, QueueAhead, count_stream, max_output_tokens, priced
from batch_dagster.features.throughput import Throughput
from tests.helpers import CHAT_MODEL, KEY_B, Flood, chat_request, rows, upload, wait_for


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
    assert client.batches.list().data == [] and batch_ids(service.storage.open()) == []  # nothing created

    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, "completed")
    assert done.usage.input_tokens == first["input_tokens"]
    summary = BatchFolder(service.storage.open(), batch.id).summary()
    assert first["cost"]["min"] <= summary.cost.total_cost <= first["cost"]["max"]

    again = estimate(client, file_id)
    assert again["throughput_batches"] == 1
    assert again["tokens_per_s"] == pytest.approx(summary.usage.total_tokens / summary.inference_s, abs=0.1)
    assert again["duration_s"]["min"] == pytest.approx(first["input_tokens"] / again["tokens_per_s"], abs=0.1)

    # `batch-dagster estimate FILE --json` against the same store answers what the API answers.
    use_store(monkeypatch, service.config.database_url, service.config.storage_url)
    code, out, _ = cli(capsys, "estimate", str(tmp_path / "in.jsonl"), "--json")
    assert again["meets_deadline"] is True  # the API's estimate is for a window; a local file's has none
    assert code == 0 and json.loads(out) == {**again, "meets_deadline": None}


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
    for window, code in (("2h", "completion_window_not_offered"), ("soon", "invalid_completion_window")):
        with pytest.raises(openai.BadRequestError) as refused:
            estimate(client, file_id, completion_window=window)
        assert (refused.value.body["code"], refused.value.body["param"]) == (code, "completion_window")

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


MODEL = "m"
SERVED = {MODEL: (c.CHAT, c.COMPLETIONS, c.RESPONSES), "e": (c.EMBEDDINGS,)}
PRICES = PriceTable({MODEL: Price(input_per_1m=1.0, output_per_1m=4.0, batch_discount=0.5, currency="EUR")})


def words(endpoint: str, body: dict) -> list[int] | None:
    """A word tokenizer: the words of every message, or of each prompt; 'REFUSE' is a body its template refuses."""
    if endpoint == c.CHAT:
        text = " ".join(m["content"] for m in body["messages"])
        return None if "REFUSE" in text else [len(text.split())]
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    return [len(p.split()) for p in prompts]


def chat(cid: str, text: str, **params) -> dict:
    return {"custom_id": cid, "method": "POST", "url": c.CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], **params}}


def run(rows: list, *, context: int = 100, rate: float = 10.0, queue: QueueAhead = QueueAhead(),
        counted: list | None = None, window: Window | None = None) -> Estimate:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()

    def counter(model: str):
        if counted is not None:
            counted.append(model)
        return words, context

    file_count = count_stream(io.BytesIO(data), size=len(data), limits=c.Limits(), endpoint=None, served=SERVED,
                              counter=counter)
    return priced(file_count, PRICES, lambda m: Throughput(rate, 3), lambda m: queue, window)


@pytest.mark.parametrize(("endpoint", "body", "prompts", "bound"), [
    (c.CHAT, {"max_tokens": 7}, [10], 7),
    (c.CHAT, {"max_tokens": 7, "max_completion_tokens": 5}, [10], 5),  # the newer name wins, as in the engine
    (c.CHAT, {}, [10], 90),  # the rest of the context
    (c.CHAT, {"max_tokens": 7, "n": 3}, [10], 21),  # every choice may use it all
    (c.CHAT, {"max_tokens": 7, "n": 3, "temperature": 0}, [10], None),  # vLLM samples no n > 1 greedily
    (c.CHAT, {"max_tokens": 91}, [10], 90),  # past what the prompt leaves: cut to it, as vLLM's server does
    (c.CHAT, {"max_tokens": 101}, [10], None),  # past the context: the engine refuses it
    (c.CHAT, {"max_tokens": 0}, [10], None),
    (c.CHAT, {"max_tokens": True}, [10], None),
    (c.CHAT, {}, [100], None),  # no room for one token
    (c.COMPLETIONS, {}, [3, 4], 2 * c.COMPLETIONS_MAX_TOKENS),  # one completion per prompt, 16 tokens unless asked
    (c.COMPLETIONS, {"max_tokens": 50, "n": 2}, [40, 60], 2 * 2 * 40),  # cut by the longest prompt
    (c.COMPLETIONS, {"max_tokens": 30, "n": 2}, [40, 60], 120),
    (c.RESPONSES, {"input": "hi", "max_output_tokens": 9}, [5], 9),
    (c.EMBEDDINGS, {}, [100, 3], 0),
    (c.EMBEDDINGS, {}, [101], None),
])
def test_the_output_bound_of_a_request(endpoint, body, prompts, bound):
    assert max_output_tokens(endpoint, {"model": MODEL, **body}, prompts, 100) == bound


def test_a_file_is_tallied_priced_and_timed():
    rows = [chat("a", "one two three", max_tokens=10),  # 3 in, at most 10 out
            chat("b", "four five", max_tokens=10, n=2),  # 2 in, at most 20 out
            chat("c", "no limit given"),  # 3 in, the rest of the context: 97
            chat("d", "too long", max_tokens=101),  # past the context: an error line, not billed
            chat("e", "REFUSE me", max_tokens=5),  # the template refuses it
            chat("f", "a mistyped field", temperature="hot")]  # validation rejects the body (a 400 line)
    estimate = run(rows, queue=QueueAhead(batches=3, requests=6, uncounted=1))
    d = estimate.to_dict()
    assert d["valid"] and d["total_requests"] == 6 and d["refused_requests"] == 3
    assert d["input_tokens"] == 3 + 2 + 3 and d["max_output_tokens"] == 10 + 20 + 97
    # EUR at half price: 1.0 and 4.0 per 1M tokens, halved.
    assert d["cost"] == {"min": pytest.approx(8 * 0.5e-6), "max": pytest.approx(8 * 0.5e-6 + 127 * 2e-6),
                         "currency": "EUR"}
    # min: 8 prompt tokens at 10/s; max: 135 tokens, plus 6 queued requests of 45 tokens each, plus a batch not
    # counted yet taken as this one.
    assert d["duration_s"] == {"min": 0.8, "max": round((135 + 6 * 45 + 135) / 10, 1)}
    assert d["tokens_per_s"] == 10.0 and d["throughput_batches"] == 3
    assert d["queued_ahead"] == 3 and d["queued_ahead_requests"] == 6 and d["queued_ahead_uncounted"] == 1
    assert d["object"] == "batch.estimate" and d["errors"] == {"object": "list", "data": []}


def test_the_window_prices_the_estimate_and_its_deadline_is_met_possible_or_refused():
    rows = [chat("a", "one two three four five six seven eight nine ten", max_tokens=10)]  # 10 in, 10 out
    prices = PriceTable(PRICES.prices, windows={"1h": {"batch_discount": 0.25}})
    assert run(rows).meets_deadline() is None and run(rows).deadline_refusal() is None  # no window: no deadline
    queued = QueueAhead(batches=1, requests=1)  # min 1 s (10 prompt tokens at 10/s), max (20 + 20) / 10 = 4 s
    roomy = run(rows, queue=queued, window=Window("1h", 3600))
    assert roomy.to_dict()["meets_deadline"] is True and roomy.deadline_refusal() is None
    assert run(rows, queue=queued, window=Window("1h", 3)).to_dict()["meets_deadline"] is False  # possible, late
    tight = run(rows, queue=queued, window=Window("1h", 0))
    assert "'1h' leaves 0 s; this batch needs at least 1 s" in (tight.deadline_refusal() or "")
    one = count_stream(io.BytesIO(json.dumps(rows[0]).encode() + b"\n"), size=None, limits=c.Limits(),
                       endpoint=None, served=SERVED, counter=lambda m: (words, 100))
    windowed = priced(one, prices, lambda m: Throughput(10.0, 3), lambda m: QueueAhead(), Window("1h", 3600))
    assert windowed.to_dict()["cost"]["min"] == pytest.approx(10 * 0.75e-6)  # 1.0 per 1M at 25% off


def test_a_real_cost_of_successful_requests_lies_in_the_range():
    """Whatever the engine answers within the bounds, the billed cost is between min and max."""
    estimate = run([chat(f"r{i}", "a b c " * i, max_tokens=i + 1) for i in range(1, 6)])
    cost = estimate.to_dict()["cost"]
    for produced in (0, 1, estimate.tally.max_output_tokens):
        billed = (estimate.tally.input_tokens * 1.0 + produced * 4.0) / 1e6 * 0.5
        assert cost["min"] <= round(billed, 8) <= cost["max"]


def test_an_invalid_file_lists_its_errors_as_a_batch_does_and_no_numbers():
    rows = ["not json"] * (MAX_ERRORS + 5)
    d = run(rows).to_dict()
    assert not d["valid"] and d["total_requests"] == MAX_ERRORS + 5
    listed = d["errors"]["data"]
    assert len(listed) == MAX_ERRORS + 1 and listed[0]["line"] == 1 and listed[0]["code"] == c.INVALID_JSON
    assert listed[-1]["code"] == MORE_ERRORS and "5 more" in listed[-1]["message"]
    assert d["input_tokens"] is None and d["cost"] is None and d["duration_s"] is None


def test_a_model_not_served_loads_no_tokenizer():
    counted: list = []
    other = chat("a", "hi")
    other["body"]["model"] = "nope"
    d = run([other, chat("b", "hi")], counted=counted).to_dict()
    assert not d["valid"] and d["errors"]["data"][0]["code"] == c.MODEL_NOT_FOUND
    assert counted == []  # only the file's first model is counted, and only when it is served


def test_no_measured_rate_no_duration():
    estimate = run([chat("a", "hi", max_tokens=3)], rate=0.0)
    assert estimate.to_dict()["duration_s"] is None and estimate.to_dict()["cost"] is not None


def test_a_flood_of_one_keys_estimates_leaves_the_api_serving_everyone(start_service, tmp_path, monkeypatch):
    """45 estimates of one key, each file's tokenization held until released (the cores stay free: what runs out,
    if anything, is a pool; before the estimate lane, 40 held estimates took every worker thread and the next
    request of any key waited): past the key's bound they answer 429 at once, another key is served while the rest
    wait, and those answer once released, all from one count of the file."""
    release, counting = threading.Event(), []
    count = Models.counter

    def held(self, model, **kwargs):
        counting.append(model)
        release.wait(60)
        return count(self, model, **kwargs)

    monkeypatch.setattr(Models, "counter", held)
    service = start_service(worker=False)
    file_id = upload(service.client(), tmp_path / "in.jsonl", rows(3, max_tokens=4))
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    flood = Flood(service, "/v1/batches/estimate", body, 45)
    flood.wait_answered(45 - ESTIMATES_QUEUED_PER_KEY)
    assert set(flood.statuses) == {429} and flood.held() == ESTIMATES_QUEUED_PER_KEY and counting == [CHAT_MODEL]
    with service.http(KEY_B) as other:  # served while the key's estimates wait for their count
        assert other.get("/v1/batches", timeout=10).status_code == 200
        file_b = upload(service.client(KEY_B), tmp_path / "b.jsonl", rows(2))
        assert other.get(f"/v1/files/{file_b}", timeout=10).status_code == 200
    assert not release.is_set() and flood.held() == ESTIMATES_QUEUED_PER_KEY
    release.set()
    statuses = flood.join()
    assert statuses.count(200) == ESTIMATES_QUEUED_PER_KEY and statuses.count(429) == 45 - ESTIMATES_QUEUED_PER_KEY
    assert counting == [CHAT_MODEL]  # one count of the file, which the other estimates shared
