"""The Kubernetes Job dagster-k8s builds for the inference step, from this project's Helm values and op tags.

Rendered with dagster-k8s's own builder (what its step executor calls for each step), checked without a cluster.
"""

from __future__ import annotations

import kubernetes
import kubernetes_validate
import yaml
from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

from batch_dagster.assets.batch import batch_output_files, shard_results
from tests.helpers import REPO

VALUES = REPO / "deploy" / "helm" / "dagster-values.yaml"
KUBERNETES_VERSION = "1.30.0"


def step_job(tags: dict[str, str]) -> dict:
    """The step Job for an op with `tags`, in a run launched with deploy/helm/dagster-values.yaml, as a manifest."""
    values = yaml.safe_load(VALUES.read_text())
    (code,) = values["dagster-user-deployments"]["deployments"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    config = DagsterK8sJobConfig(
        job_image=f"{code['image']['repository']}:{code['image']['tag']}",
        dagster_home="/opt/dagster/dagster_home",
        image_pull_policy=launcher["imagePullPolicy"],
        instance_config_map="dagster-instance",
        postgres_password_secret=values["global"]["postgresqlSecretName"],
        env_config_maps=[m["name"] for m in launcher["envConfigMaps"]],
        env_secrets=[s["name"] for s in launcher["envSecrets"]],
        volume_mounts=launcher["volumeMounts"],
        volumes=launcher["volumes"],
        resources=launcher["resources"],
    )
    job = construct_dagster_k8s_job(
        config, ["dagster", "api", "execute_step"], "dagster-step-0123456789", component="step_worker",
        user_defined_k8s_config=get_user_defined_k8s_config(tags),
        env_vars=[{"name": "DAGSTER_RUN_STEP_KEY", "value": "shard_results"}],
    )
    return kubernetes.client.ApiClient().sanitize_for_serialization(job)


def test_the_inference_step_pod_asks_for_a_gpu():
    values = yaml.safe_load(VALUES.read_text())
    image = values["dagster-user-deployments"]["deployments"][0]["image"]
    manifest = step_job(shard_results.op.tags)
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)

    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert int(container["resources"]["requests"]["memory"].removesuffix("Gi")) >= 6  # the offline engine's peak RSS
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    # The environment the code reads: BATCH_* from the ConfigMap, keys and S3 credentials from the Secrets, the
    # instance's Postgres password and DAGSTER_HOME from the chart.
    env_from = [next(iter(source.values()))["name"] for source in container["envFrom"]]
    assert env_from == ["batch-dagster-env", "batch-dagster-secrets", "batch-dagster-aws"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DAGSTER_HOME"]["value"] == "/opt/dagster/dagster_home"
    assert env["DAGSTER_PG_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "dagster-postgresql-secret"
    assert env["DAGSTER_RUN_STEP_KEY"]["value"] == "shard_results"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data", "/etc/batch-dagster"}


def test_other_steps_get_no_gpu():
    (container,) = step_job(batch_output_files.op.tags)["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in str(container["resources"])
