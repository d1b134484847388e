"""One file per endpoint, carrying every accepted field (honored, or accepted with no effect here), through the in-process engine and through a fleet
(`batch-dagster fleet`: a vLLM server behind vllm-router), compared line by line, ids and timestamps aside.

Both run the same registry copy: float32 (so greedy answers compare exactly), the embedded models, SmolLM2 with
a tool-call parser (hermes), a reasoning parser (olmo3: `<think>` in plain text) and a chat template that also
renders what SmolLM2's own template ignores (documents, template variables, tool calls): fields that only a template
or a parser reads show their effect through it. Each honored field's effect is asserted on the in-process answers, and
the lines carrying the accepted no-ops are answered as the plain ones; the fleet's answers are the same. Run it under the fleet lock (its router binds the metrics port):
`flock /work/.locks/fleet .venv/bin/python -m pytest tests/system/test_parity.py`.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.fields import FIELDS
from tests.helpers import CHAT_MODEL, EMBED_MODEL, MODEL_CACHE, real_vllm, run_on_real_engine

pytestmark = pytest.mark.engine

# SmolLM2's own template, and what it leaves out: documents, template variables, tool calls in the history.
TEMPLATE = """\
{%- if documents %}{{ '<|im_start|>system\nDocuments:\n' }}{% for d in documents %}{{ d['title'] ~ ': ' ~ d['text'] \
~ '\n' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif -%}
{%- if reasoning_effort is defined and reasoning_effort %}{{ '<|im_start|>system\nReasoning effort: ' ~ \
reasoning_effort ~ '<|im_end|>\n' }}{% endif -%}
{%- if style is defined %}{{ '<|im_start|>system\nStyle: ' ~ style ~ '<|im_end|>\n' }}{% endif -%}
{%- if enable_thinking is defined and not enable_thinking %}{{ '<|im_start|>system\nThinking: off<|im_end|>\n' }}\
{% endif -%}
{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are \
a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + \
message['role'] + '\n' + (message['content'] or '') }}{% if message.tool_calls %}{% for call in message.tool_calls %}\
{{ '<tool_call>\n{"name": "' ~ call.function.name ~ '", "arguments": ' ~ (call.function.arguments if \
call.function.arguments is string else call.function.arguments | tojson) ~ '}\n</tool_call>' }}{% endfor %}{% endif %}\
{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

REGISTRY = """\
[defaults]
dtype = "float32"
seed = 0
kv_cache_memory_bytes = 1073741824

[models.{chat}]
source = "embedded:smollm2"
max_model_len = 2048
max_num_seqs = 256
enable_prefix_caching = true
tool_call_parser = "hermes"
reasoning_parser = "olmo3"
# The reasoning here is forced by a grammar, which must hold from the first token.
engine_args = {{ enforce_eager = true, chat_template = "{template}", structured_outputs_config = {{ \
enable_in_reasoning = true }} }}

[models.{embed}]
source = "embedded:all-minilm-l6-v2"
task = "embed"
max_model_len = 256
engine_args = {{ enforce_eager = true }}
"""

Q = "What is the capital of France?"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                         "strict": True, "parameters": CITY}}
TOOL2 = {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "strict": True,
                                          "parameters": CITY}}
RTOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city", "strict": True,
         "parameters": CITY}
THINK = r"<think>[a-z ]{5,20}</think>[A-Z][a-z]{2,12}"
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
REPEAT = "Write the word dog ten times."
AS_JSON = "Answer in JSON with one key, city: what is the capital of France?"


def line(url: str, cid: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def chat(cid: str, content: str = Q, **fields) -> dict:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 0, **fields}
    return line(c.CHAT, cid, body)


def completion(cid: str, prompt: object = "The capital of France is", **fields) -> dict:
    return line(c.COMPLETIONS, cid, {"model": CHAT_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                     **fields})


def response(cid: str, given: object = Q, **fields) -> dict:
    return line(c.RESPONSES, cid, {"model": CHAT_MODEL, "input": given, "max_output_tokens": 16, "temperature": 0,
                                   **fields})


def embedding(cid: str, text: object = "A cat sleeps on the sofa.", **fields) -> dict:
    return line(c.EMBEDDINGS, cid, {"model": EMBED_MODEL, "input": text, **fields})


# The accepted no-ops (fields.py: accepted, no effect here), those vLLM would refuse (left out before it) included.
NO_EFFECT_OPENAI = {"store": True, "service_tier": "flex", "prompt_cache_key": "k", "prompt_cache_options": {"ttl": "30m"},
                    "prompt_cache_retention": "24h", "safety_identifier": "s-1", "user": "u-1"}
NO_EFFECT_CHAT = {**NO_EFFECT_OPENAI, "metadata": {"team": "geo"}, "modalities": ["text"], "verbosity": "low",
                  "prediction": {"type": "content", "content": "The capital of France is Paris."}}
NO_EFFECT_GENERATING = {"priority": 5, "session_id": "s-1", "watermarking": False, "mm_payload": "none",
                        "return_mm_kwargs": False, "kv_transfer_params": {"do_remote_prefill": True},
                        "ec_transfer_params": {}}
NO_EFFECT_SAMPLING = {"spaces_between_special_tokens": False, "return_token_offsets": True, "stream_interval": 4,
                      "routed_experts_prompt_start": 1}


def chat_rows(ids: dict[str, int]) -> list[dict]:
    paris, the, capital, of = ids[" Paris"], ids["The"], ids[" capital"], ids[" of"]
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    return [
        chat("base"),
        chat("no-effect", stream=False, cache_salt="user-1", **NO_EFFECT_GENERATING, **NO_EFFECT_SAMPLING,
             **NO_EFFECT_CHAT),
        chat("greedy-top-k", temperature=1.0, top_k=1),
        chat("greedy-top-p", temperature=1.0, top_p=1e-9),
        chat("greedy-min-p", temperature=1.0, min_p=1.0),
        chat("seeded-a", temperature=1.0, seed=7, max_tokens=12),
        chat("seeded-b", temperature=1.0, seed=7, max_tokens=12),
        chat("n3", temperature=0.9, seed=3, n=3, max_tokens=8),
        chat("max-completion", max_completion_tokens=3),
        chat("stop", stop=["France"]),
        chat("stop-kept", stop=["France"], include_stop_str_in_output=True),
        chat("stop-id", stop_token_ids=[paris]),
        chat("plain-repeat", REPEAT, max_tokens=24),
        chat("penalties", REPEAT, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0),
        chat("repetition", REPEAT, max_tokens=24, repetition_penalty=2.0),
        chat("repetition-detected", REPEAT, max_tokens=24, repetition_detection={"max_pattern_size": 2, "min_count": 3}),
        chat("logit-bias", logit_bias={str(paris): -100}),
        chat("bad-words", bad_words=["Paris"]),
        chat("allowed", allowed_token_ids=[the, capital, of], return_token_ids=True, max_tokens=6),
        chat("logprobs", logprobs=True, top_logprobs=3, max_tokens=4),
        chat("ids-as-text", logprobs=True, return_tokens_as_token_ids=True, max_tokens=2),
        chat("prompt-logprobs", prompt_logprobs=1, max_tokens=1),
        chat("token-ids", return_token_ids=True, add_special_tokens=True, max_tokens=3),
        chat("truncated", truncate_prompt_tokens=5, return_token_ids=True, max_tokens=2),
        chat("truncated-right", truncate_prompt_tokens=5, truncation_side="right", return_token_ids=True,
             max_tokens=2),
        chat("min-tokens", "Say yes.", min_tokens=12, max_tokens=16),
        chat("ignore-eos", ignore_eos=True, max_tokens=20),
        chat("special-kept", skip_special_tokens=False, ignore_eos=True, max_tokens=12),
        chat("json-schema", response_format=SCHEMA, max_tokens=40),
        chat("json-object", AS_JSON, response_format={"type": "json_object"}, max_tokens=200),
        chat("json-cut", response_format=SCHEMA, max_tokens=3),
        chat("text-format", response_format={"type": "text"}),
        chat("regex", structured_outputs={"regex": "[0-9]{3}"}),
        chat("choice", structured_outputs={"choice": ["yes", "no"]}),
        chat("tool-required", tools=[TOOL], tool_choice="required", max_tokens=150),
        chat("tool-named", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             max_tokens=150),
        # The model does not call tools on its own: the grammar writes the call, the parser (auto) must find it.
        chat("tool-auto", tools=[TOOL], tool_choice="auto", structured_outputs={"regex": CALL}, max_tokens=150),
        chat("tool-none", tools=[TOOL], tool_choice="none"),
        chat("tool-single", tools=[TOOL, TOOL2], tool_choice="required", parallel_tool_calls=False, max_tokens=200),
        line(c.CHAT, "tool-history", {"model": CHAT_MODEL, "messages": history, "tools": [TOOL],
                                      "tool_choice": "none", "max_tokens": 16, "temperature": 0,
                                      "return_prompt_text": True}),
        chat("reasoning", structured_outputs={"regex": THINK}, max_tokens=40),
        chat("reasoning-hidden", structured_outputs={"regex": THINK}, include_reasoning=False, max_tokens=40),
        chat("effort", reasoning_effort="low", return_prompt_text=True, max_tokens=2),
        chat("documents", documents=[{"title": "Atlas", "text": "Paris is in France."}], return_prompt_text=True,
             max_tokens=2),
        chat("template-kwargs", chat_template_kwargs={"style": "pirate"}, return_prompt_text=True, max_tokens=2),
        chat("thinking-off", enable_thinking=False, return_prompt_text=True, max_tokens=2),
        chat("no-generation-prompt", add_generation_prompt=False, return_prompt_text=True, max_tokens=2),
        line(c.CHAT, "continue", {"model": CHAT_MODEL, "messages": [
            {"role": "user", "content": Q}, {"role": "assistant", "content": "The capital of France is"}],
            "continue_final_message": True, "add_generation_prompt": False, "echo": True, "max_tokens": 4,
            "temperature": 0}),
        chat("beam", use_beam_search=True, n=3, max_tokens=8),
        chat("beam-long", use_beam_search=True, n=3, length_penalty=100.0, max_tokens=8),
    ]


def completion_rows(ids: dict[str, int]) -> list[dict]:
    paris = ids[" Paris"]
    return [
        completion("base"),
        completion("default-length", max_tokens=None, user="u-1", stream=False, cache_salt="user-1"),
        completion("no-effect", best_of=1, **NO_EFFECT_GENERATING, **NO_EFFECT_SAMPLING),
        # A grammar makes the text repeat (and past the end-of-text); the detection ends it early.
        # (The grammar writes " dog" in about three tokens: the pattern is up to 4 long.)
        completion("repetition-detected", structured_outputs={"regex": "( dog)+"}, ignore_eos=True, max_tokens=16,
                   repetition_detection={"max_pattern_size": 4, "min_count": 3}),
        completion("echo", echo=True),
        completion("logprobs", logprobs=2, max_tokens=3),
        completion("prompts", ["One, two,", "Monday, Tuesday,"], max_tokens=4),
        completion("token-prompt", [ids["The"], ids[" capital"], ids[" of"], ids[" France"], ids[" is"]]),
        completion("n2", temperature=0.9, seed=5, n=2, max_tokens=6),
        completion("stop", stop=["."], include_stop_str_in_output=True, max_tokens=16),
        completion("stop-id", stop_token_ids=[paris]),
        completion("json", response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
                   max_tokens=40),
        completion("choice", structured_outputs={"choice": ["yes", "no"]}),
        completion("sampled", temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=11, frequency_penalty=0.5,
                   presence_penalty=0.5, repetition_penalty=1.2, max_tokens=12),
        completion("bias", logit_bias={str(paris): -100}, bad_words=["Lyon"]),
        completion("long", ignore_eos=True, min_tokens=12, max_tokens=12, skip_special_tokens=False),
        completion("details", prompt_logprobs=1, return_token_ids=True, add_special_tokens=False, max_tokens=2),
        completion("allowed", allowed_token_ids=[paris], max_tokens=3),
        completion("as-ids", logprobs=1, return_tokens_as_token_ids=True, max_tokens=2),
        completion("truncated", "one two three four five six seven eight", truncate_prompt_tokens=3,
                   truncation_side="left", max_tokens=2),
        completion("beam", use_beam_search=True, n=2, length_penalty=1.0, max_tokens=6),
        *(completion(f"shared-{i}", f"{SHARED} Question {i}: where is the city?", max_tokens=4) for i in range(6)),
    ]


def response_rows(ids: dict[str, int]) -> list[dict]:
    paris = ids[" Paris"]
    history = [{"type": "message", "role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    text_format = {"type": "json_schema", "name": "city", "strict": True, "schema": CITY}
    return [
        response("base", instructions="Answer in one short sentence.", user="u-1", metadata={"team": "geo"},
                 stream=False, store=False, service_tier="auto", cache_salt="user-1"),
        response("plain"),
        # What inspect_ai sends on every line, and the other no-ops.
        response("no-effect", include=["reasoning.encrypted_content", "web_search_call.action.sources"],
                 background=True, background_options={"completion_window": "2h"}, max_tool_calls=2,
                 access_programs={"cyber": "standard"}, **NO_EFFECT_GENERATING, **NO_EFFECT_OPENAI),
        response("items", [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
                 top_p=1.0),
        response("cut", max_output_tokens=3),
        response("json-schema", text={"format": text_format}, max_output_tokens=40),
        response("json-object", AS_JSON, text={"format": {"type": "json_object"}}, max_output_tokens=200),
        response("json-cut", text={"format": text_format}, max_output_tokens=3),
        response("tool-required", tools=[RTOOL], tool_choice="required", max_output_tokens=150),
        response("tool-named", tools=[RTOOL], tool_choice={"type": "function", "name": "get_weather"},
                 max_output_tokens=150),
        response("tool-auto", tools=[RTOOL], tool_choice="auto", structured_outputs={"regex": CALL},
                 max_output_tokens=150),
        response("tool-none", tools=[RTOOL], tool_choice="none", parallel_tool_calls=False),
        response("tool-history", history, tools=[RTOOL], tool_choice="none"),
        response("logprobs", top_logprobs=2, include=["message.output_text.logprobs"], max_output_tokens=3),
        response("long-input", "word " * 2500, truncation="auto", max_output_tokens=2),
        response("effort", reasoning={"effort": "low"}, max_output_tokens=2),
        response("reasoning", structured_outputs={"regex": THINK}, max_output_tokens=40),
        response("reasoning-included", structured_outputs={"regex": THINK}, include=["reasoning.encrypted_content"],
                 max_output_tokens=40),
        response("reasoning-hidden", structured_outputs={"regex": THINK}, include_reasoning=False,
                 max_output_tokens=40),
        response("template-kwargs", chat_template_kwargs={"style": "pirate"}, max_output_tokens=2),
        response("messages", enable_response_messages=True, max_output_tokens=2),
        response("sampled", temperature=0.8, seed=9, top_k=20, min_p=0.05, repetition_penalty=1.2,
                 presence_penalty=0.5, frequency_penalty=0.5, max_output_tokens=12),
        response("stop", stop=["France"], include_stop_str_in_output=True),
        response("stop-id", stop_token_ids=[paris]),
        response("bias", logit_bias={str(paris): -100}),
        response("long", ignore_eos=True, skip_special_tokens=False, max_output_tokens=12),
    ]


def anthropic_message(cid: str, content: object = Q, **fields) -> dict:
    body = {"model": CHAT_MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": content}],
            "temperature": 0}
    return line(c.MESSAGES, cid, {**body, **fields})


ATOOL = {"name": "get_weather", "description": "The weather of a city", "input_schema": CITY}


def message_rows() -> list[dict]:
    """Anthropic Messages lines, answered by vLLM's Messages layer; the last two are refused at their line."""
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    weather = "What is the weather in Paris?"
    return [
        anthropic_message("base"),
        anthropic_message("no-effect", stream=False, cache_salt="user-1", metadata={"user_id": "u-1"},
                          service_tier="standard_only", inference_geo="us", speed="standard",
                          cache_control={"type": "ephemeral"}, workspace_id="w-1", user_profile_id="p-1",
                          watermarking=False, mm_payload="none", return_mm_kwargs=False,
                          kv_transfer_params={"do_remote_prefill": True}, ec_transfer_params={}),
        anthropic_message("blocks", [{"type": "text", "text": Q}]),
        anthropic_message("system", system="Answer in one short sentence."),
        anthropic_message("system-blocks", system=[{"type": "text", "text": "Answer in one short sentence."}]),
        anthropic_message("greedy-top-k", temperature=1.0, top_k=1),
        anthropic_message("greedy-top-p", temperature=1.0, top_p=1e-9),
        anthropic_message("cut", max_tokens=3),
        anthropic_message("stop", stop_sequences=["France"]),
        anthropic_message("json-schema", output_config={"format": {"type": "json_schema", "schema": CITY}},
                          max_tokens=40),
        anthropic_message("effort", output_config={"effort": "low"}, max_tokens=2),
        anthropic_message("thinking-off", thinking={"type": "disabled"}, max_tokens=2),
        anthropic_message("thinking-adaptive", thinking={"type": "adaptive"}, max_tokens=2),
        anthropic_message("tool-named", weather, tools=[ATOOL], tool_choice={"type": "tool", "name": "get_weather"},
                          max_tokens=150),
        anthropic_message("tool-any", weather, tools=[ATOOL], tool_choice={"type": "any"}, max_tokens=150),
        anthropic_message("tool-none", weather, tools=[ATOOL], tool_choice={"type": "none"}),
        anthropic_message("tool-history", messages=history, tools=[ATOOL], tool_choice={"type": "auto"}),
        anthropic_message("template-kwargs", chat_template_kwargs={"style": "pirate"}, max_tokens=2),
        anthropic_message("refused-thinking", thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048),
        anthropic_message("refused-document", [{"type": "document", "source": {"type": "text", "data": "x"}}]),
    ]


def embedding_rows() -> list[dict]:
    return [
        embedding("base", user="u-1", cache_salt="user-1"),
        embedding("texts", ["A cat sleeps.", "Taxes are due."]),
        embedding("tokens", [101, 4937, 102]),
        embedding("b64", encoding_format="base64"),
        embedding("f16", encoding_format="base64", embed_dtype="float16"),
        embedding("big-endian", encoding_format="base64", endianness="big"),
        embedding("raw", use_activation=False),
        embedding("truncated", truncate_prompt_tokens=3, encoding_format="float"),
        embedding("truncated-right", truncate_prompt_tokens=3, truncation_side="right"),
        embedding("no-special", add_special_tokens=False),
        embedding("padded", padding="max_length"),
        embedding("no-effect", priority=3),
    ]


CAT, KITTEN, TAXES = "A cat sleeps on the sofa.", "The kitten naps on the couch.", "Taxes are due next week."


def score(cid: str, **fields) -> dict:
    return line(c.SCORE, cid, {"model": EMBED_MODEL, "queries": CAT, "documents": [KITTEN, TAXES], **fields})


def rerank(cid: str, **fields) -> dict:
    return line(c.RERANK, cid, {"model": EMBED_MODEL, "query": CAT, "documents": [TAXES, KITTEN], **fields})


def score_rows() -> list[dict]:
    return [
        score("base", user="u-1", cache_salt="user-1"),
        score("pairs", queries=[CAT, TAXES], documents=[KITTEN, "The tax office is closed."]),
        score("truncated", truncate_prompt_tokens=4),
        score("truncated-right", truncate_prompt_tokens=4, truncation_side="right"),
        score("short-query", max_tokens_per_query=3),
        score("short-docs", max_tokens_per_doc=3),
        score("padded", padding="max_length"),
        score("no-effect", use_activation=False, priority=3),
    ]


def rerank_rows() -> list[dict]:
    return [
        rerank("base", user="u-1", cache_salt="user-1"),
        rerank("top", top_n=1),
        rerank("truncated", truncate_prompt_tokens=4, truncation_side="left"),
        rerank("short", max_tokens_per_query=3, max_tokens_per_doc=3),
        rerank("padded", padding="max_length"),
        rerank("no-effect", use_activation=False, priority=3),
    ]


# Honored fields no line needs to carry: the prompt and model every line has.
CARRIED_BY_EVERY_LINE = {"model", "messages", "prompt", "input", "queries", "query", "documents", "max_tokens"}


def test_every_accepted_field_is_carried_by_a_line():
    ids = {t: i for i, t in enumerate([" Paris", "The", " capital", " of", " France", " is"])}
    rows = {c.CHAT: chat_rows(ids), c.COMPLETIONS: completion_rows(ids), c.RESPONSES: response_rows(ids),
            c.EMBEDDINGS: embedding_rows(), c.SCORE: score_rows(), c.RERANK: rerank_rows(), c.MESSAGES: message_rows()}
    for url, lines in rows.items():
        carried = {k for row in lines for k in row["body"]} | CARRIED_BY_EVERY_LINE
        accepted = {name for name, f in FIELDS[url].items() if f.accepted}
        assert accepted <= carried, (url, sorted(accepted - carried))


# -- the two runs ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("parity")
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    path = folder / "models.toml"
    path.write_text(REGISTRY.format(chat=CHAT_MODEL, embed=EMBED_MODEL, template=template))
    return path


@pytest.fixture(scope="module")
def token_ids(registry) -> dict[str, int]:
    from transformers import AutoTokenizer

    vllm = real_vllm(models_file=str(registry))
    tokenizer = AutoTokenizer.from_pretrained(vllm.model_path(vllm.spec(CHAT_MODEL)))
    ids = {}
    for text in (" Paris", "The", " capital", " of", " France", " is"):
        [ids[text]] = tokenizer.encode(text, add_special_tokens=False)
    return ids


# The completions file runs in shards of 5, and six of its prompts share a text longer than a KV cache block (128
# tokens on the CPU backend): the later shard of the six finds it in the prefix cache, which its lines' usage counts
# (prompt_tokens_details.cached_tokens). Within one engine step nothing hits: a block is cached once computed.
SHARD_SIZE = {"completions": 5}
SHARED = "The history of the city: " + "Paris grew on the banks of the Seine, a river crossing the north of France. " * 12


def files(ids: dict[str, int]) -> dict[str, tuple[str, list[dict]]]:
    return {"chat": (CHAT_MODEL, chat_rows(ids)), "completions": (CHAT_MODEL, completion_rows(ids)),
            "responses": (CHAT_MODEL, response_rows(ids)), "embeddings": (EMBED_MODEL, embedding_rows()),
            "score": (EMBED_MODEL, score_rows()), "rerank": (EMBED_MODEL, rerank_rows()),
            "messages": (CHAT_MODEL, message_rows())}


def run_all(tmp_path: Path, data_dir: Path, instance, ids: dict[str, int], **vllm) -> dict[str, tuple]:
    out = {}
    for name, (_, rows) in files(ids).items():
        folder = tmp_path / name
        folder.mkdir()
        out[name] = run_on_real_engine(folder, data_dir, instance, rows, **vllm)
    return out


class Fleet:
    """`batch-dagster fleet MODEL --replicas 1` on the registry copy, as a user starts one; its router's base URL."""

    def __init__(self, model: str, registry: Path, log: Path):
        env = {**os.environ, "BATCH_MODELS_FILE": str(registry), "BATCH_MODEL_CACHE": str(MODEL_CACHE),
               "BATCH_DATA_DIR": str(log.parent)}
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "batch_dagster.cli", "fleet", model, "--replicas", "1"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        printed = self.proc.stdout.readline().strip()  # once the replica and the router are healthy
        if not printed.endswith("/v1"):
            self.stop()
            raise RuntimeError(f"the fleet did not start: {log.read_text()[-3000:]}")
        self.url = printed.removesuffix("/v1")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def runs(registry, token_ids, tmp_path_factory) -> dict[str, dict[str, tuple]]:
    """Every file through the in-process engine, then (its engines stopped) through a fleet of each model:
    {"in-process" | "fleet": {file: (summary, output lines, error lines)}}."""
    from batch_dagster.engine.offline import drop_engine
    from tests.helpers import dagster_instance

    tmp = tmp_path_factory.mktemp("runs")
    out: dict[str, dict[str, tuple]] = {"in-process": {}, "fleet": {}}
    with dagster_instance() as instance:
        for name, (_, rows) in files(token_ids).items():
            folder = tmp / "in-process" / name
            folder.mkdir(parents=True)
            out["in-process"][name] = run_on_real_engine(folder, folder / "data", instance, rows,
                                                         SHARD_SIZE.get(name, 1000), models_file=str(registry))
        drop_engine(CHAT_MODEL)  # one engine of ours alive at a time
        drop_engine(EMBED_MODEL)
        for model in (CHAT_MODEL, EMBED_MODEL):
            fleet = Fleet(model, registry, tmp / f"fleet-{model}.log")
            try:
                for name, (file_model, rows) in files(token_ids).items():
                    if file_model != model:
                        continue
                    folder = tmp / "fleet" / name
                    folder.mkdir(parents=True)
                    out["fleet"][name] = run_on_real_engine(folder, folder / "data", instance, rows,
                                                            SHARD_SIZE.get(name, 1000), models_file=str(registry),
                                                            fleet_urls={model: fleet.url})
            finally:
                fleet.stop()
    return out


# -- the same lines --------------------------------------------------------------------------------------------------

# Unique per call: response and tool-call ids (a response's function_call names its call by one), timestamps, an
# error line's request id.
# cached_tokens too: which of two lines sharing a prefix is scheduled first (and so finds the other's blocks cached)
# varies from run to run on either path; the file's total (the summary's usage, compared below) does not.
VOLATILE = {"id", "created", "created_at", "call_id", "cached_tokens", "request_id"}


def stable(value: object) -> object:
    """`value` without what is unique per call."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def same(a: object, b: object, where: str = "") -> list[str]:
    """Where `a` and `b` differ: exactly, floats (log probabilities, embeddings) to 1e-5."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} != {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("name", ["chat", "completions", "responses", "embeddings", "score", "rerank", "messages"])
def test_the_in_process_engine_and_a_fleet_write_the_same_lines(runs, name):
    s1, out1, err1 = runs["in-process"][name]
    s2, out2, err2 = runs["fleet"][name]
    assert s1["status"] == s2["status"] == "completed"
    assert (set(out1), set(err1)) == (set(out2), set(err2))
    differences = {cid: d for cid in out1 if (d := same(stable(out1[cid]["response"]["body"]),
                                                           stable(out2[cid]["response"]["body"])))}
    differences |= {cid: d for cid in err1 if (d := same(stable(err1[cid]["response"]), stable(err2[cid]["response"])))
                    and d != same({}, {})}
    assert differences == {}, json.dumps(differences, indent=1)[:6000]
    assert s1["request_counts"] == s2["request_counts"] and s1["usage"] == s2["usage"]
    assert s1["engine"]["mode"] == "offline" and s2["engine"]["mode"] == "server"


# -- each honored field's effect, on the in-process answers ---------------------------------------------------------

def bodies(runs, name: str) -> dict[str, dict]:
    summary, out, err = runs["in-process"][name]
    assert err == {}, {cid: e["response"]["body"] for cid, e in err.items()}
    return {cid: x["response"]["body"] for cid, x in out.items()}


def message(body: dict, i: int = 0) -> dict:
    return body["choices"][i]["message"]


def text(body: dict, i: int = 0) -> str:
    return message(body, i)["content"] or ""


def test_chat_fields_have_their_effect(runs, token_ids):
    b = bodies(runs, "chat")
    base = text(b["base"])
    assert "Paris" in base and b["base"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    for cid in ("no-effect", "greedy-top-k", "greedy-top-p", "greedy-min-p", "text-format"):
        assert text(b[cid]) == base, cid
    assert text(b["seeded-a"]) == text(b["seeded-b"])
    assert len(b["n3"]["choices"]) == 3
    assert b["max-completion"]["usage"]["completion_tokens"] == 3
    assert b["max-completion"]["choices"][0]["finish_reason"] == "length"
    stop, kept = b["stop"]["choices"][0], b["stop-kept"]["choices"][0]
    assert (stop["finish_reason"], stop["stop_reason"]) == ("stop", "France") and "France" not in text(b["stop"])
    assert text(b["stop-kept"]).endswith("France") and kept["stop_reason"] == "France"
    assert b["stop-id"]["choices"][0]["stop_reason"] == token_ids[" Paris"] and "Paris" not in text(b["stop-id"])
    assert text(b["penalties"]) != text(b["plain-repeat"]) and text(b["repetition"]) != text(b["plain-repeat"])
    detected = b["repetition-detected"]["usage"]["completion_tokens"]
    assert detected < b["plain-repeat"]["usage"]["completion_tokens"], (text(b["plain-repeat"]), detected)
    assert text(b["plain-repeat"]).startswith(text(b["repetition-detected"]))
    assert "Paris" not in text(b["logit-bias"]) and "Paris" not in text(b["bad-words"])
    allowed = {token_ids["The"], token_ids[" capital"], token_ids[" of"]}
    assert set(b["allowed"]["choices"][0]["token_ids"]) <= allowed
    content = b["logprobs"]["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == text(b["logprobs"]) and len(content) == 4
    for t in content:  # the token itself first (greedy), then the next 2 most likely, none a padding -9999
        top = [x["logprob"] for x in t["top_logprobs"]]
        assert t["top_logprobs"][0]["token"] == t["token"] and len(top) == 3, content
        assert 0 >= t["logprob"] == top[0] >= top[1] >= top[2] > -9999, content
    assert all(t["token"].startswith("token_id:") for t in b["ids-as-text"]["choices"][0]["logprobs"]["content"])
    assert len(b["prompt-logprobs"]["prompt_logprobs"]) == b["prompt-logprobs"]["usage"]["prompt_tokens"]
    full = b["token-ids"]["prompt_token_ids"]
    assert len(full) == b["token-ids"]["usage"]["prompt_tokens"] and len(b["token-ids"]["choices"][0]["token_ids"]) == 3
    assert b["truncated"]["prompt_token_ids"] == full[-5:] and b["truncated-right"]["prompt_token_ids"] == full[:5]
    assert b["min-tokens"]["usage"]["completion_tokens"] >= 12
    assert b["ignore-eos"]["usage"]["completion_tokens"] == 20
    assert "<|im_end|>" in text(b["special-kept"]) and "<|im_end|>" not in text(b["ignore-eos"])
    assert set(json.loads(text(b["json-schema"]))) == {"city"}
    assert isinstance(json.loads(text(b["json-object"])), dict)
    assert b["json-cut"]["choices"][0]["finish_reason"] == "length"
    assert re.fullmatch("[0-9]{3}", text(b["regex"])) and text(b["choice"]) in ("yes", "no")
    for cid in ("tool-required", "tool-named", "tool-auto", "tool-single"):
        [call] = message(b[cid])["tool_calls"]
        assert call["function"]["name"] in ("get_weather", "get_time"), cid
        assert set(json.loads(call["function"]["arguments"])) == {"city"}, cid
    assert b["tool-required"]["choices"][0]["finish_reason"] == "tool_calls"
    assert not message(b["tool-none"]).get("tool_calls") and text(b["tool-none"])
    assert '<tool_call>\n{"name": "get_weather"' in b["tool-history"]["prompt_text"]
    reasoning = message(b["reasoning"])
    assert reasoning["reasoning"] and reasoning["content"] and "<think>" not in reasoning["content"]
    hidden = message(b["reasoning-hidden"])
    assert hidden["reasoning"] is None and hidden["content"] == reasoning["content"]
    assert "Reasoning effort: low" in b["effort"]["prompt_text"]
    assert "Atlas: Paris is in France." in b["documents"]["prompt_text"]
    assert "Style: pirate" in b["template-kwargs"]["prompt_text"]
    assert "Thinking: off" in b["thinking-off"]["prompt_text"]
    assert not b["no-generation-prompt"]["prompt_text"].endswith("<|im_start|>assistant\n")
    assert b["effort"]["prompt_text"].endswith("<|im_start|>assistant\n")
    assert text(b["continue"]).startswith("The capital of France is") and len(text(b["continue"])) > 24
    beams, long_beams = [text(b["beam"], i) for i in range(3)], [text(b["beam-long"], i) for i in range(3)]
    assert len(set(beams)) == 3 and beams != long_beams  # the length penalty reorders the beams


def test_completions_fields_have_their_effect(runs, token_ids):
    b = bodies(runs, "completions")

    def t(cid: str, i: int = 0) -> str:
        return b[cid]["choices"][i]["text"]

    assert "Paris" in t("base") and b["default-length"]["usage"]["completion_tokens"] == 16  # OpenAI's default
    assert t("echo").startswith("The capital of France is") and t("echo").endswith(t("base"))
    logprobs = b["logprobs"]["choices"][0]["logprobs"]
    assert [len(x) for x in logprobs["top_logprobs"]] == [2, 2, 2]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):  # greedy: the most likely
        assert top[token] == max(top.values()) > -9999, logprobs
    assert [ch["index"] for ch in b["prompts"]["choices"]] == [0, 1]
    assert t("token-prompt") == t("base") == t("no-effect") and len(b["n2"]["choices"]) == 2
    assert t("stop").endswith(".") and b["stop"]["choices"][0]["stop_reason"] == "."
    assert b["stop-id"]["choices"][0]["stop_reason"] == token_ids[" Paris"]
    assert set(json.loads(t("json"))) == {"city"} and t("choice") in ("yes", "no")
    assert b["sampled"]["usage"]["completion_tokens"] > 0 and "Paris" not in t("bias")
    assert b["long"]["usage"]["completion_tokens"] == 12
    details = b["details"]
    assert len(details["choices"][0]["prompt_logprobs"]) == details["usage"]["prompt_tokens"] == 5
    assert details["choices"][0]["prompt_token_ids"] == [token_ids[w] for w in ("The", " capital", " of", " France",
                                                                                " is")]
    assert t("allowed") == " Paris" * 3
    assert all(x.startswith("token_id:") for x in b["as-ids"]["choices"][0]["logprobs"]["tokens"])
    assert b["truncated"]["usage"]["prompt_tokens"] == 3 and len(b["beam"]["choices"]) == 2
    assert t("repetition-detected").startswith(" dog dog")
    assert b["repetition-detected"]["usage"]["completion_tokens"] < 16  # ended early, though past the end-of-text


def test_responses_fields_have_their_effect(runs, token_ids):
    b = bodies(runs, "responses")

    def items(cid: str, kind: str) -> list[dict]:
        return [item for item in b[cid]["output"] if item["type"] == kind]

    def t(cid: str) -> str:
        return "".join(part["text"] for item in items(cid, "message") for part in item["content"])

    base = b["base"]
    assert "Paris" in t("base") and base["metadata"] == {"team": "geo"} and base["status"] == "completed"
    assert base["instructions"] == "Answer in one short sentence." and t("items")
    no_effect = b["no-effect"]  # answered as the plain line; what was left out is vLLM's default in the echo
    assert t("no-effect") == t("plain") and no_effect["status"] == "completed" and no_effect["background"] is False
    assert no_effect["service_tier"] == "auto" and not items("no-effect", "reasoning")
    assert b["cut"]["status"] == "incomplete" and b["cut"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert set(json.loads(t("json-schema"))) == {"city"} and isinstance(json.loads(t("json-object")), dict)
    assert b["json-cut"]["status"] == "incomplete"
    for cid in ("tool-required", "tool-named", "tool-auto"):
        [call] = items(cid, "function_call")
        assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}, cid
    assert not items("tool-none", "function_call") and b["tool-none"]["parallel_tool_calls"] is False
    assert b["tool-history"]["usage"]["input_tokens"] > base["usage"]["input_tokens"]
    [logprobs] = [part["logprobs"] for item in items("logprobs", "message") for part in item["content"]]
    assert len(logprobs) == 3 and all(len(x["top_logprobs"]) == 2 for x in logprobs)
    assert b["long-input"]["usage"]["input_tokens"] < 2048 < 2 * 2500  # cut to fit instead of refused
    assert b["effort"]["usage"]["input_tokens"] > b["cut"]["usage"]["input_tokens"]
    [reasoning] = items("reasoning", "reasoning")
    assert reasoning["content"][0]["text"] and not items("reasoning-hidden", "reasoning")
    assert t("reasoning") == t("reasoning-hidden") == t("reasoning-included")
    [included] = items("reasoning-included", "reasoning")  # what vLLM returns for the include: its reasoning item
    assert included["content"] == reasoning["content"]
    assert b["template-kwargs"]["usage"]["input_tokens"] > b["cut"]["usage"]["input_tokens"]
    assert b["messages"]["input_messages"] and b["messages"]["output_messages"]
    assert "France" in t("stop") and t("stop").endswith("France")
    assert "Paris" not in t("stop-id") and "Paris" not in t("bias")
    assert b["long"]["usage"]["output_tokens"] == 12 and b["sampled"]["usage"]["output_tokens"] > 0


def test_embeddings_fields_have_their_effect(runs):
    b = bodies(runs, "embeddings")

    def vector(cid: str, i: int = 0) -> list[float]:
        return b[cid]["data"][i]["embedding"]

    def norm(v: list[float]) -> float:
        return math.sqrt(sum(x * x for x in v))

    base = vector("base")
    assert len(base) == 384 and norm(base) == pytest.approx(1.0, abs=1e-4)
    assert [d["index"] for d in b["texts"]["data"]] == [0, 1] and b["tokens"]["usage"]["prompt_tokens"] == 3
    decoded = struct.unpack("<384f", base64.b64decode(vector("b64")))
    assert decoded == pytest.approx(base, abs=1e-6)
    assert len(base64.b64decode(vector("f16"))) == 384 * 2
    assert struct.unpack(">384f", base64.b64decode(vector("big-endian"))) == pytest.approx(base, abs=1e-6)
    assert norm(vector("raw")) > 1.5  # before normalization
    assert b["truncated"]["usage"]["prompt_tokens"] == b["truncated-right"]["usage"]["prompt_tokens"] == 3
    assert vector("truncated") != pytest.approx(vector("truncated-right"), abs=1e-3)
    assert b["no-special"]["usage"]["prompt_tokens"] == b["base"]["usage"]["prompt_tokens"] - 2
    assert b["padded"]["usage"]["prompt_tokens"] > b["base"]["usage"]["prompt_tokens"]
    assert vector("no-effect") == pytest.approx(base, abs=1e-6)


def test_score_and_rerank_fields_have_their_effect(runs):
    s, r = bodies(runs, "score"), bodies(runs, "rerank")

    def scores(cid: str) -> list[float]:
        return [d["score"] for d in sorted(s[cid]["data"], key=lambda d: d["index"])]

    kitten, taxes = scores("base")
    assert kitten > taxes + 0.3 and s["base"]["usage"]["prompt_tokens"] > 0
    assert len(scores("pairs")) == 2
    for cid in ("truncated", "truncated-right", "short-query", "short-docs"):
        assert s[cid]["usage"]["prompt_tokens"] < s["base"]["usage"]["prompt_tokens"], cid
    assert scores("truncated") != pytest.approx(scores("truncated-right"), abs=1e-4)
    assert scores("no-effect") == pytest.approx(scores("base"), abs=1e-5)
    assert s["padded"]["usage"]["prompt_tokens"] > s["base"]["usage"]["prompt_tokens"]
    assert r["padded"]["usage"]["prompt_tokens"] > r["base"]["usage"]["prompt_tokens"]
    ranks = {cid: [(x["index"], x["relevance_score"]) for x in r[cid]["results"]] for cid in ("base", "no-effect")}
    assert [i for i, _ in ranks["no-effect"]] == [i for i, _ in ranks["base"]]
    assert [x for _, x in ranks["no-effect"]] == pytest.approx([x for _, x in ranks["base"]], abs=1e-5)
    ranked = r["base"]["results"]
    assert [x["index"] for x in ranked] == [1, 0]  # the kitten first, though listed second
    assert ranked[0]["relevance_score"] > ranked[1]["relevance_score"]
    assert [x["index"] for x in r["top"]["results"]] == [1]
    for cid in ("truncated", "short"):
        assert r[cid]["usage"]["prompt_tokens"] < r["base"]["usage"]["prompt_tokens"], cid


def test_summaries_count_cut_structured_outputs_and_price_cached_tokens(runs):
    for name, cut in (("chat", 1), ("responses", 1), ("completions", 0)):
        summary, out, _ = runs["in-process"][name]
        assert summary["request_counts"].get("incomplete_structured", 0) == cut, name
        usage = summary["usage"]
        assert usage["input_tokens"] == sum(
            (x["response"]["body"]["usage"].get("prompt_tokens") or x["response"]["body"]["usage"].get(
                "input_tokens") or 0) for x in out.values())
        cached = usage["input_tokens_details"]["cached_tokens"]
        expected = ((usage["input_tokens"] - cached) * 0.10 + cached * 0.025 + usage["output_tokens"] * 0.40) / 1e6
        assert summary["cost"]["total_cost"] == pytest.approx(expected * 0.5, rel=1e-6)
        assert summary["cost"]["cached_input_cost"] == pytest.approx(cached * 0.025 / 1e6 * 0.5, rel=1e-6)
    # The shared text of the completions file's later shard was served by the prefix cache, and priced so.
    assert runs["in-process"]["completions"][0]["usage"]["input_tokens_details"]["cached_tokens"] >= 128


def test_messages_fields_have_their_effect(runs):
    """Each line answered by vLLM's Messages layer with an Anthropic message; the refused ones are 400 lines that say
    why, at their field."""
    summary, out, err = runs["in-process"]["messages"]
    b = {cid: x["response"]["body"] for cid, x in out.items()}

    def said(body: dict) -> str:
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")

    base = said(b["base"])
    assert b["base"]["type"] == "message" and b["base"]["role"] == "assistant" and "Paris" in base
    for cid in ("no-effect", "blocks", "greedy-top-k", "greedy-top-p"):
        assert said(b[cid]) == base, cid
    assert b["cut"]["usage"]["output_tokens"] == 3 and b["cut"]["stop_reason"] == "max_tokens"
    assert (b["stop"]["stop_reason"], b["stop"]["stop_sequence"]) == ("stop_sequence", "France")
    assert "France" not in said(b["stop"])
    assert set(json.loads(said(b["json-schema"]))) == {"city"}
    for cid in ("tool-named", "tool-any"):
        [call] = [block for block in b[cid]["content"] if block["type"] == "tool_use"]
        assert call["name"] == "get_weather" and set(call["input"]) == {"city"}, cid
        assert b[cid]["stop_reason"] == "tool_use", cid
    assert not [block for block in b["tool-none"]["content"] if block["type"] == "tool_use"] and said(b["tool-none"])
    assert said(b["tool-history"]) or b["tool-history"]["content"]
    assert set(err) == {"refused-thinking", "refused-document"}
    thinking = err["refused-thinking"]["response"]
    assert thinking["status_code"] == 400 and thinking["body"]["error"]["param"] == "thinking"
    assert "--reasoning-config" in thinking["body"]["error"]["message"]
    assert err["refused-document"]["response"]["body"]["error"]["param"] == "messages[0].content[0]"
    usage = summary["usage"]
    assert usage["input_tokens"] == sum(x["usage"]["input_tokens"] + x["usage"].get("cache_read_input_tokens", 0)
                                        for x in b.values())
    assert usage["output_tokens"] == sum(x["usage"]["output_tokens"] for x in b.values())
