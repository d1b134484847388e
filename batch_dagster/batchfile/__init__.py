"""The pure core: the OpenAI batch file contract, validation, sharding, merging, usage and cost.

Imports no Dagster, vLLM, FastAPI or SQLAlchemy; every adapter of the project builds on it.
"""
