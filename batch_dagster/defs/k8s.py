"""What the Kubernetes deployment (deploy/) needs from the code: the tags that size the inference step's pod."""

from __future__ import annotations

from typing import Any

# dagster-k8s reads these from an op's tags when a run executes step by step in pods (k8s_job_executor): the
# shard_results step, which holds the in-process vLLM engine, gets one GPU, the host memory the offline engine
# peaked at in the benchmark (~6 GB RSS, docs/performance.md) plus headroom, and may land on tainted GPU nodes.
# Runs in server mode (a vLLM fleet behind the router) hold no engine and need none of this.
GPU_STEP_TAGS: dict[str, Any] = {
    "dagster-k8s/config": {
        "container_config": {
            "resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}},
        },
        "pod_spec_config": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
}
