"""The OpenAI-compatible HTTP API (FastAPI): Files and Batches, handed to Dagster by the sensors."""
