"""Talking to vLLM: translating batch requests to engine calls and engine results to output lines.

`offline` runs a `vllm.LLM` in this process; `server` sends requests to OpenAI-compatible vLLM
servers. Both take a shard's requests and return one output line per request.
"""
