"""Talking to vLLM: a shard's requests through vLLM's own OpenAI layer, each answered by its batch line.

`offline` serves `vllm serve`'s application in this process; `server` sends requests to vLLM servers (a fleet's
replicas). Both run the same flags (`flags`), send the same bodies (`base.dispatch`) and make the same lines (`lines`).
"""
