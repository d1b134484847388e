"""The Kubernetes Jobs dagster-k8s builds for a run and for the inference step, from this project's Helm values and op
tags.

Rendered with dagster-k8s's own code, checked without a cluster: its run launcher configured as the chart configures
it, the run's container context merged as for a launched run (the launcher's, then the code location's when the chart
passes it on), and the Job builder its launcher and step executor call.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import TYPE_CHECKING
from unittest import mock

import dagster as dg
import pytest
import yaml

from batch_dagster.defs.assets.batch import lifecycle
from batch_dagster.settings import default
from tests.helpers import REPO

if TYPE_CHECKING:
    from dagster_k8s import K8sRunLauncher

# kubernetes, kubernetes_validate and dagster_k8s are imported where they are used: at collection they were 0.5 s of
# each pytest worker's, most of which run none of these tests.

VALUES = REPO / "deploy" / "helm" / "dagster-values.yaml"
validated_requests, shard_results, batch_output_files = (
    next(a for a in lifecycle(default("BATCH_STEP_RETRY_DELAY_S")) if a.key.path[-1] == name)
    for name in ("validated_requests", "shard_results", "batch_output_files"))
KUBERNETES_VERSION = "1.30.0"
# `helm upgrade --install dagster dagster/dagster -n batch-dagster` (docs/deploy.md): the chart's full name is
# "dagster", and the names below are the ones its templates derive from it.
RELEASE, NAMESPACE, DAGSTER_HOME = "dagster", "batch-dagster", "/opt/dagster/dagster_home"


def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def env_config() -> dict[str, str]:
    docs = yaml.safe_load_all((REPO / "deploy" / "k8s" / "config.yaml").read_text())
    return next(doc for doc in docs if doc["metadata"]["name"] == "batch-dagster-env")["data"]


def run_launcher(values: dict) -> K8sRunLauncher:
    """The K8sRunLauncher of the instance's dagster.yaml as the chart writes it
    (helm/dagster/templates/helpers/instance/_run-launcher.tpl), without a cluster to connect to."""
    from dagster_k8s import K8sRunLauncher

    config = values["runLauncher"]["config"]["k8sRunLauncher"]
    with mock.patch("dagster_k8s.launcher.load_kubernetes_config"):
        return K8sRunLauncher(
            load_incluster_config=config["loadInclusterConfig"],
            job_namespace=config.get("jobNamespace") or NAMESPACE,
            image_pull_policy=config["imagePullPolicy"],
            service_account_name=RELEASE,
            dagster_home=DAGSTER_HOME,
            instance_config_map=f"{RELEASE}-instance",
            postgres_password_secret=values["global"]["postgresqlSecretName"],
            # The chart puts its own pipeline-env ConfigMap first.
            env_config_maps=[f"{RELEASE}-pipeline-env", *[m["name"] for m in config["envConfigMaps"]]],
            env_secrets=[s["name"] for s in config["envSecrets"]],
            env_vars=config["envVars"],
            volume_mounts=config["volumeMounts"],
            volumes=config["volumes"],
            resources=config.get("resources"),
            k8s_client_batch_api=object(), k8s_client_core_api=object(),
        )


def code_location_context(values: dict) -> dict | None:
    """The container context the chart hands the code server (DAGSTER_CLI_API_GRPC_CONTAINER_CONTEXT), which every run
    it launches inherits; None when includeConfigInLaunchedRuns is off (the chart's default is on). As the chart's
    dagster-user-deployments helper `dagsterUserDeployments.k8sContainerContext` renders it."""
    (code,) = values["dagster-user-deployments"]["deployments"]
    if not code.get("includeConfigInLaunchedRuns", {"enabled": True})["enabled"]:
        return None
    k8s = {
        "image_pull_policy": code["image"]["pullPolicy"],
        "env_config_maps": [f"{RELEASE}-dagster-user-deployments-{code['name']}-user-env",
                            *[m["name"] for m in code.get("envConfigMaps", [])]],
        "env_secrets": [s["name"] for s in code.get("envSecrets", [])],
        "volume_mounts": code.get("volumeMounts"),
        "volumes": code.get("volumes"),
        "resources": code.get("resources"),
        "namespace": NAMESPACE,
    }
    return {"k8s": {key: value for key, value in k8s.items() if value}}


def _run(values: dict, tags: dict) -> SimpleNamespace:
    """What dagster-k8s reads of a run: its code origin (image, container context) and tags."""
    (code,) = values["dagster-user-deployments"]["deployments"]
    origin = SimpleNamespace(container_image=f"{code['image']['repository']}:{code['image']['tag']}",
                             container_context=code_location_context(values))
    return SimpleNamespace(job_code_origin=SimpleNamespace(repository_origin=origin), tags=tags)


def _manifest(job) -> dict:
    import kubernetes

    return kubernetes.client.ApiClient().sanitize_for_serialization(job)


def run_job(values: dict) -> dict:
    """The run worker's Job, as K8sRunLauncher.launch_run builds it: the pod every run gets (with the default executor,
    it runs every step, shard_results included)."""
    from dagster_k8s.job import construct_dagster_k8s_job

    launcher, run = run_launcher(values), _run(values, tags={})
    context = launcher.get_container_context_for_run(run)
    job = construct_dagster_k8s_job(
        context.get_k8s_job_config(run.job_code_origin.repository_origin.container_image, launcher),
        ["dagster", "api", "execute_run"], "dagster-run-0123456789", component="run_worker",
        user_defined_k8s_config=context.run_k8s_config,
        env_vars=[{"name": "DAGSTER_RUN_JOB_NAME", "value": "batch_job"}],
    )
    return _manifest(job)


def step_job(values: dict, tags: dict[str, str]) -> dict:
    """The Job for an op with `tags`, as k8s_job_executor builds it for each step: the run's container context (without
    run tags), then the op's dagster-k8s/config tags."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import construct_dagster_k8s_job, get_user_defined_k8s_config

    launcher, run = run_launcher(values), _run(values, tags={})
    context = K8sContainerContext.create_for_run(run, launcher, include_run_tags=False).merge(
        K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(tags)))
    job = construct_dagster_k8s_job(
        context.get_k8s_job_config(run.job_code_origin.repository_origin.container_image, launcher),
        ["dagster", "api", "execute_step"], "dagster-step-0123456789", component="step_worker",
        user_defined_k8s_config=context.run_k8s_config,
        env_vars=[{"name": "DAGSTER_RUN_STEP_KEY", "value": "shard_results"}],
    )
    return _manifest(job)


def validate(manifest: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_inference_step_pod_asks_for_a_gpu():
    image = values()["dagster-user-deployments"]["deployments"][0]["image"]
    manifest = step_job(values(), shard_results.op.tags)
    validate(manifest)

    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert int(container["resources"]["requests"]["memory"].removesuffix("Gi")) >= 6  # the offline engine's peak RSS
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    # The environment the code reads: the chart's pipeline env, BATCH_* from the ConfigMap, keys and S3 credentials
    # from the Secrets, the instance's Postgres password and DAGSTER_HOME from the chart.
    env_from = [next(iter(source.values()))["name"] for source in container["envFrom"]]
    assert env_from == ["dagster-pipeline-env", "batch-dagster-env", "batch-dagster-secrets", "batch-dagster-aws"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DAGSTER_HOME"]["value"] == DAGSTER_HOME
    assert env["DAGSTER_PG_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "dagster-postgresql-secret"
    assert env["DAGSTER_RUN_STEP_KEY"]["value"] == "shard_results"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data", "/etc/batch-dagster"}


def test_other_steps_get_no_gpu():
    (container,) = step_job(values(), batch_output_files.op.tags)["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in str(container["resources"])


def test_run_pods_read_the_batch_storage_and_keep_only_scratch():
    launcher = values()["runLauncher"]["config"]["k8sRunLauncher"]
    config = env_config()
    assert config["BATCH_STORAGE_URL"].startswith("s3://")
    jobs = {"run": run_job(values())} | {op.name: step_job(values(), op.tags)
                                         for op in (validated_requests.op, shard_results.op, batch_output_files.op)}
    for name, manifest in jobs.items():
        validate(manifest)
        pod = manifest["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        # BATCH_STORAGE_URL and BATCH_DATA_DIR come from the ConfigMap, and nothing in the pod overrides them.
        assert {"configMapRef": {"name": "batch-dagster-env"}} in container["envFrom"], name
        assert not {"BATCH_STORAGE_URL", "BATCH_DATA_DIR"} & {e["name"] for e in container["env"]}, name
        # Each volume once (the API server rejects a pod with two of one name), none of them a claim.
        names = [v["name"] for v in pod["volumes"]]
        assert len(names) == len(set(names)), (name, names)
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v], name
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == config["BATCH_DATA_DIR"]]
        (scratch,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert scratch["emptyDir"]["sizeLimit"], name
    # The run pod is sized by the launcher's values (docs/deploy.md's sizing), not by the code server's.
    (container,) = jobs["run"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == launcher["resources"]


def test_the_rendering_merges_the_code_servers_pod_when_the_chart_would():
    # With includeConfigInLaunchedRuns on (the chart's default), dagster-k8s merges the code server's resources and
    # volumes into each run pod: the checks above would see the code server's size and two `scratch` volumes.
    on = copy.deepcopy(values())
    (code,) = on["dagster-user-deployments"]["deployments"]
    code["includeConfigInLaunchedRuns"]["enabled"] = True
    pod = run_job(on)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["requests"] == code["resources"]["requests"]
    assert [v["name"] for v in pod["volumes"]].count("scratch") == 2


def test_the_executor_of_batch_job_is_configuration():
    from dagster_k8s import k8s_job_executor

    from batch_dagster.definitions import defs
    from batch_dagster.defs.jobs import batch_executor

    job = defs().resolve_job_def("batch_job")  # as the settings build it, when the definitions load
    assert job.executor_def is dg.in_process_executor  # the default: one process per run
    assert batch_executor("multiprocess") is dg.multiprocess_executor
    assert batch_executor("k8s") is k8s_job_executor  # a pod per step: the GPU tags above take effect
    with pytest.raises(ValueError, match="BATCH_EXECUTOR"):
        batch_executor("threads")
