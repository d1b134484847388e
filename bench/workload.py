"""The benchmark workloads: fixed-seed, realistic OpenAI batch files.

`mixed` (the default): prompt lengths run from a few words to ~1,500 tokens with a long tail
(log-normal), half of the requests open with one of three long system prompts (so a prefix
cache can hit), max_tokens is 16-128 and temperature 0. The same (n, model, seed) always gives
the same bytes.

`docqa`: requests that share context, as document question answering writes them: D documents
of ~800-1,500 tokens with Q questions each (one request per question: the shared system
prompt, then the document, then the question), max_tokens 16-64, temperature 0, the lines
shuffled as a user would write them (not grouped by document).

`structured`: N labelling and extraction requests (default 900), the structured modes in turn (STRUCTURED_MODES:
JSON schemas with enums, bounded numbers, nested objects and arrays, strict and not; a JSON object; forced tool calls,
named and required, strict and not, parallel and single; one whose `uniqueItems` the grammar does not enforce), each
on a ticket of 20-120 words, max_tokens 200, temperature 0.

`embeddings`: N texts to embed (one /v1/embeddings request each, on the embedded embedding model), of mixed
length: a few words to ~180 (the model reads 256 tokens at most), median ~30, log-normal.

    python -m bench.workload 5000 data/bench/input.jsonl [--model NAME]
    python -m bench.workload 100 data/bench/docqa.jsonl --docqa-questions 5   # 100 documents x 5
"""

from __future__ import annotations

import argparse
import math
import os
import random
from collections.abc import Callable
from pathlib import Path

import orjson

SEED = 0
MAX_PROMPT_TOKENS = 1500
URL = "/v1/chat/completions"
TOKENS_PER_WORD = 1.1

# Common English words: SmolLM2's tokenizer spends ~1.1 tokens per word here (TOKENS_PER_WORD).
WORDS = (
    "the of and to in is was for on are with as at be this have from by they we say her she or an will my "
    "one all would there their what so up out if about who get which go me when make can like time no just "
    "him know take people into year your good some could them see other than then now look only come its over "
    "think also back after use two how our work first well way even new want because any these give day most "
    "us great small large old young long little right high different place world life hand part child eye "
    "woman man week case point government company number group problem fact house water room mother area money "
    "story month lot book job word business issue side kind head service friend father power hour game line end "
    "member law car city community name president team minute idea kid body information nothing ago lead social "
    "understand whether watch together follow around parent stop face anything create public already speak "
    "others read level allow add office spend door health person art sure such war history party within grow "
    "result open change morning walk reason low win research girl guy early food before moment himself air "
    "teacher force offer enough both education across although remember foot second boy maybe toward able age "
    "policy everything love process music including consider appear actually buy probably human wait serve "
    "market die send expect home sense build stay fall nation plan cut college interest death course someone "
    "experience behind reach local kill six remain effect suggest class control raise care perhaps late hard "
    "field else pass former sell major sometimes require along development themselves report role better "
    "economic effort decide rate strong possible heart drug show leader light voice wife police mind price"
).split()

TASKS = (
    "Summarize the following text in two sentences:",
    "Answer the question using the notes below.",
    "Classify the topic of this message and explain why:",
    "Rewrite the paragraph below in plain language:",
    "List the three main points of this text:",
    "Write a short reply to this customer message:",
    "Extract every person and place named in the text:",
    "Translate the following text into French:",
)

# Three long system prompts (~250, ~450 and ~700 tokens): the shared prefixes of half the requests.
_SYSTEM_OPENINGS = (
    ("You are the support assistant of a large online store. Follow the policy below exactly. ", 250),
    ("You are a careful research assistant for a newspaper. Read the style guide below first. ", 450),
    ("You are a legal document reviewer. The following rules govern every answer you give. ", 700),
)


def prose(rng: random.Random, n: int) -> str:
    """n words of filler prose, with a full stop every 8-20 words."""
    out, since = [], 0
    stop = rng.randint(8, 20)
    for _ in range(n):
        w = rng.choice(WORDS)
        if since == 0:
            w = w.capitalize()
        since += 1
        if since >= stop:
            w += "."
            since, stop = 0, rng.randint(8, 20)
        out.append(w)
    return " ".join(out)


def system_prompts(seed: int = SEED) -> list[str]:
    rng = random.Random(f"system-{seed}")
    return [opening + prose(rng, int(size / TOKENS_PER_WORD)) for opening, size in _SYSTEM_OPENINGS]


def _prompt_tokens(rng: random.Random) -> int:
    """A prompt length in tokens: median ~90, a long tail to MAX_PROMPT_TOKENS, at least a few words."""
    return max(4, min(MAX_PROMPT_TOKENS, int(math.exp(rng.gauss(math.log(90), 1.1)))))


def requests(n: int, model: str, seed: int = SEED):
    """The n request lines (dicts) of the workload, in file order."""
    rng = random.Random(seed)
    systems = system_prompts(seed)
    system_sizes = [size for _, size in _SYSTEM_OPENINGS]
    for i in range(n):
        tokens = _prompt_tokens(rng)
        messages = []
        if rng.random() < 0.5:
            k = rng.randrange(3)
            messages.append({"role": "system", "content": systems[k]})
            # The system prompt counts toward the prompt: keep the whole under MAX_PROMPT_TOKENS.
            tokens = max(4, min(tokens, MAX_PROMPT_TOKENS - system_sizes[k] - 20))
        task = rng.choice(TASKS)
        words = max(1, int(tokens / TOKENS_PER_WORD))
        body_words = max(1, words - len(task.split()))
        messages.append({"role": "user", "content": f"{task} {prose(rng, body_words)}" if tokens > 12
                         else prose(rng, words)})
        yield {
            "custom_id": f"req-{i:06d}",
            "method": "POST",
            "url": URL,
            "body": {"model": model, "messages": messages, "max_tokens": rng.randint(16, 128), "temperature": 0},
        }


# 60 documents (about 70,000 tokens) outgrow the registry's 1 GiB KV cache (46,592 tokens), as a corpus outgrows any
# cache: what makes the order matter. At 100 the bench takes twice as long to show the same thing.
DOCQA_DOCS, DOCQA_QUESTIONS = 60, 5
DOCQA_DOC_TOKENS = (800, 1500)
DOCQA_MAX_TOKENS = (16, 64)
DOCQA_SYSTEM = ("You are a careful reading assistant. Answer the question about the document the user gives, "
                "using only what the document says, in one or two sentences. If the document does not say, "
                "answer that it does not.")
_QUESTIONS = (
    "What does the document say about {}?",
    "Why is {} mentioned in the document?",
    "Summarize what the document tells about {} in one sentence.",
    "Who or what is connected with {} in the document?",
    "Does the document give a reason for {}?",
    "What happens to {} in the document?",
    "How does the document describe {}?",
)


def docqa_requests(docs: int, questions: int, model: str, seed: int = SEED):
    """docs x questions request lines (dicts), shuffled; custom_id doc-DDDD-qQQ names each one's document."""
    rng = random.Random(f"docqa-{seed}")
    rows = []
    for d in range(docs):
        document = prose(rng, int(rng.randint(*DOCQA_DOC_TOKENS) / TOKENS_PER_WORD))
        topics = rng.sample(WORDS, questions)
        for q in range(questions):
            question = rng.choice(_QUESTIONS).format(topics[q])
            rows.append({
                "custom_id": f"doc-{d:04d}-q{q:02d}",
                "method": "POST",
                "url": URL,
                "body": {"model": model, "messages": [
                    {"role": "system", "content": DOCQA_SYSTEM},
                    {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"},
                ], "max_tokens": rng.randint(*DOCQA_MAX_TOKENS), "temperature": 0},
            })
    rng.shuffle(rows)
    return rows


# The structured workload: labelling and extraction, as users send them, in every structured mode (STRUCTURED_MODES),
# the lines interleaved. Its strings have a maxLength, as a labelling schema's do: a small model may otherwise run a
# string to max_tokens.
STRUCTURED_MAX_TOKENS = 200
_SENTIMENT = {"type": "object", "additionalProperties": False, "required": ["sentiment", "confidence"], "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}
_EXTRACT = {"type": "object", "additionalProperties": False, "required": ["customer", "products", "urgent"],
            "properties": {
                "customer": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                             "properties": {"name": {"type": "string", "maxLength": 30},
                                            "age": {"type": "integer", "minimum": 18, "maximum": 99}}},
                "products": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                "urgent": {"type": "boolean"}}}
_TOPICS = ("billing", "delivery", "quality", "support", "price", "account")
_TAGS = {"type": "object", "additionalProperties": False, "required": ["tags", "priority"], "properties": {
    "tags": {"type": "array", "items": {"enum": list(_TOPICS)}, "minItems": 1, "maxItems": 3},
    "priority": {"type": "integer", "minimum": 1, "maximum": 5}}}
_LABEL_TOOL = {"name": "record_label", "description": "Record the ticket's category and priority",
               "parameters": {"type": "object", "required": ["category", "priority"], "properties": {
                   "category": {"enum": list(_TOPICS)}, "priority": {"type": "integer", "minimum": 1, "maximum": 5}}}}
_CONTACT_TOOL = {"name": "record_contact", "description": "Record who wrote the ticket",
                 "parameters": {"type": "object", "required": ["name"], "properties": {
                     "name": {"type": "string", "maxLength": 30}, "email": {"type": "string", "maxLength": 40}}}}

# Unique topics: xgrammar leaves `uniqueItems` out of a tool's grammar, so this call is constrained but for that.
_TOPICS_TOOL = {"name": "record_topics", "description": "Record the ticket's topics, each once",
                "parameters": {"type": "object", "required": ["topics"], "properties": {"topics": {
                    "type": "array", "items": {"enum": list(_TOPICS)}, "minItems": 1, "maxItems": 3,
                    "uniqueItems": True}}}}


def _tools(strict: bool = False) -> list[dict]:
    return [{"type": "function", "function": {**t, **({"strict": True} if strict else {})}}
            for t in (_LABEL_TOOL, _CONTACT_TOOL)]


def _schema(name: str, schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


_NAMED = {"type": "function", "function": {"name": "record_label"}}
# mode -> (the task's words, the body's structured fields)
STRUCTURED_MODES: dict[str, tuple[str, dict]] = {
    "json_schema_enum": ("Label the sentiment of this review, with your confidence:",
                         {"response_format": _schema("sentiment", _SENTIMENT)}),
    "json_schema_nested": ("Extract the customer, the products named and whether it is urgent:",
                           {"response_format": _schema("extraction", _EXTRACT, strict=False)}),
    "json_schema_array": ("Tag this support ticket with its topics and a priority from 1 to 5:",
                          {"response_format": _schema("tags", _TAGS)}),
    "json_object": ("Answer in JSON with one key, topic: what is this message about?",
                    {"response_format": {"type": "json_object"}}),
    "tool_named": ("Record the category and priority of this ticket.", {"tools": _tools(), "tool_choice": _NAMED}),
    "tool_named_strict": ("Record the category and priority of this ticket.",
                          {"tools": _tools(strict=True), "tool_choice": _NAMED}),
    "tool_required": ("Record this ticket.", {"tools": _tools(), "tool_choice": "required"}),
    "tool_required_single": ("Record this ticket.", {"tools": _tools(), "tool_choice": "required",
                                                      "parallel_tool_calls": False}),
    "tool_unique_items": ("Record the topics of this ticket.", {
        "tools": [{"type": "function", "function": _TOPICS_TOOL}],
        "tool_choice": {"type": "function", "function": {"name": "record_topics"}}}),
}


def structured_mode(custom_id: str) -> str:
    """The mode of a structured workload's line, from its custom_id (`<mode>-<n>`)."""
    return custom_id.rsplit("-", 1)[0]


def structured_requests(n: int, model: str, seed: int = SEED):
    """The n request lines (dicts) of the structured workload: the modes in turn, each on a ticket of 20-120 words."""
    rng = random.Random(f"structured-{seed}")
    modes = list(STRUCTURED_MODES)
    for i in range(n):
        mode = modes[i % len(modes)]
        task, fields = STRUCTURED_MODES[mode]
        text = prose(rng, rng.randint(20, 120))
        yield {"custom_id": f"{mode}-{i:06d}", "method": "POST", "url": URL, "body": {
            "model": model, "messages": [{"role": "user", "content": f"{task}\n\n{text}"}],
            "max_tokens": STRUCTURED_MAX_TOKENS, "temperature": 0, **fields}}


EMBED_MODEL = "all-minilm-l6-v2"
EMBED_TEXTS = 10_000
EMBED_MAX_WORDS = 180


def embedding_requests(n: int, model: str, seed: int = SEED):
    """The n /v1/embeddings request lines (dicts) of the embeddings workload, in file order."""
    rng = random.Random(f"embed-{seed}")
    for i in range(n):
        words = max(2, min(EMBED_MAX_WORDS, int(math.exp(rng.gauss(math.log(30), 0.9)))))
        yield {"custom_id": f"text-{i:06d}", "method": "POST", "url": "/v1/embeddings",
               "body": {"model": model, "input": prose(rng, words)}}


def _write_lines(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for line in lines:
            f.write(orjson.dumps(line) + b"\n")
    return path


def write_workload(path: Path, n: int, model: str, seed: int = SEED) -> Path:
    return _write_lines(path, requests(n, model, seed))


def write_docqa(path: Path, docs: int, questions: int, model: str, seed: int = SEED) -> Path:
    return _write_lines(path, docqa_requests(docs, questions, model, seed))


def workload_model() -> str:
    """The model the bench runs: BENCH_MODEL, else the workload's (the embedding model for `embeddings`)."""
    if os.environ.get("BENCH_MODEL"):
        return os.environ["BENCH_MODEL"]
    return EMBED_MODEL if os.environ.get("BENCH_WORKLOAD") == "embeddings" else "smollm2-135m-instruct"


def workload_from_env(model: str) -> tuple[int, str, Callable[[Path], Path]]:
    """The bench's workload as BENCH_WORKLOAD says: its request count, its description and its writer."""
    workload = os.environ.get("BENCH_WORKLOAD") or "mixed"
    if workload == "embeddings":
        n = int(os.environ.get("BENCH_REQUESTS") or EMBED_TEXTS)
        return n, "embeddings", lambda path: _write_lines(path, embedding_requests(n, model))
    if workload == "docqa":
        docs = int(os.environ.get("BENCH_DOCQA_DOCS") or DOCQA_DOCS)
        questions = int(os.environ.get("BENCH_DOCQA_QUESTIONS") or DOCQA_QUESTIONS)
        return (docs * questions, f"docqa {docs} documents x {questions} questions",
                lambda path: write_docqa(path, docs, questions, model))
    if workload == "structured":
        n = int(os.environ.get("BENCH_REQUESTS") or 900)
        return n, "structured", lambda path: _write_lines(path, structured_requests(n, model))
    if workload == "mixed":
        n = int(os.environ.get("BENCH_REQUESTS") or 5000)
        return n, "mixed", lambda path: write_workload(path, n, model)
    raise ValueError(f"Unknown BENCH_WORKLOAD {workload!r}; choose mixed, docqa, embeddings or structured")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help="requests (mixed) or documents (with --docqa-questions)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--docqa-questions", type=int, default=0, help="the docqa workload, this many per document")
    args = parser.parse_args()
    if args.docqa_questions:
        write_docqa(args.out, args.n, args.docqa_questions, args.model, args.seed)
    else:
        write_workload(args.out, args.n, args.model, args.seed)


if __name__ == "__main__":
    main()
