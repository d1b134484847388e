"""The Dagster side: assets, resources, sensors, jobs, partitions, run limits, the instance, the daemon, k8s tags,
internals.

Nothing outside this package imports Dagster, except the CLI's `run` command (through runner.py).
"""
