"""Stage 1 of the benchmark, run as its own process: the raw engine, every request in one `llm.chat` call (or, for
an embeddings file, every text in one `llm.embed` call), in the order the pipeline runs them (sharding's `ordered`:
shared prefixes together, the longest work first), so it is the engine's best on this file.

The engine settings are the registry's (`engine.flags.engine_kwargs(spec, path)`), so this is the
same engine the pipeline builds. Prints one JSON object: engine_start_s (the `LLM(...)`
constructor), inference_s (the one `llm.chat` call, chat templating included), output_tokens,
prompt and prefix-cache-hit tokens (per request and vLLM's own counters), each answer's text, written to RESULT.json
(vLLM logs to stdout).

    python -m bench.raw_engine INPUT.jsonl LLM_KWARGS_JSON RESULT.json
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> None:
    from batch_dagster.batchfile.shard import features, ordered

    input_path, kwargs_json, result_path = sys.argv[1:4]
    conversations, params_kwargs, texts, custom_ids = [], [], [], []
    with open(input_path, "rb") as f:
        lines = [json.loads(raw) for raw in f if raw.strip()]
    order, _ = ordered([features(line["url"], line["body"]) for line in lines])
    for line in (lines[i] for i in order):
        custom_ids.append(line["custom_id"])
        body = line["body"]
        if line["url"] == "/v1/embeddings":
            texts.append(body["input"])
            continue
        conversations.append(body["messages"])
        params_kwargs.append({"max_tokens": body["max_tokens"], "temperature": body["temperature"]})

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**json.loads(kwargs_json))
    t1 = time.perf_counter()
    print("BENCH engine ready", file=sys.stderr, flush=True)
    outputs: list[Any]
    answers: dict[str, Any]
    if texts:
        outputs = llm.embed(texts, use_tqdm=False)
        answers = {cid: out.outputs.embedding for cid, out in zip(custom_ids, outputs, strict=True)}
        output_tokens = 0
    else:
        params = [SamplingParams(**p) for p in params_kwargs]
        outputs = llm.chat(conversations, params, use_tqdm=False)
        answers = {cid: out.outputs[0].text for cid, out in zip(custom_ids, outputs, strict=True)}
        output_tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    t2 = time.perf_counter()
    print("BENCH inference done", file=sys.stderr, flush=True)
    prompt_tokens = sum(len(out.prompt_token_ids or []) for out in outputs)
    cached_tokens = sum(getattr(out, "num_cached_tokens", 0) or 0 for out in outputs)
    # vLLM's Prometheus counters, summed over their labels: a cross-check of the per-request counts.
    # The offline LLM keeps them only with stat logging on (disable_log_stats=False in the registry's engine_args).
    counters: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except AssertionError:  # "Stat logging disabled": the per-request counts above stand alone
        metrics = []
    for metric in metrics:
        if metric.name in ("vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            counters[metric.name] = counters.get(metric.name, 0) + getattr(metric, "value", 0)
    with open(result_path, "w") as f:
        json.dump({
            "engine_start_s": round(t1 - t0, 3),
            "inference_s": round(t2 - t1, 3),
            "requests": len(outputs),
            "input_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "output_tokens": output_tokens,
            "engine_counters": counters,
            "answers": answers,
        }, f)
    llm.llm_engine.engine_core.shutdown(timeout=0)  # as run_batch does: no 5 s grace period at exit


if __name__ == "__main__":
    main()
