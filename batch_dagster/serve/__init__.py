"""Serving: `python -m batch_dagster.serve` (the API, the Dagster UI and daemon, a warm fleet), the fleet of vLLM
servers behind vllm-router, and the child processes they start and stop together."""
