"""deploy/ checked without a cluster: every manifest against the Kubernetes schemas, the Helm values against the
keys the Dagster chart defines."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# The oldest Kubernetes the deployment supports; strict mode also rejects fields the version does not know.
KUBERNETES_VERSION = "1.30.0"

# Key paths of the Dagster Helm chart's values.schema.json (dagster-io/dagster helm/dagster/values.schema.json, read
# at commit bdb8547fab497826eeec292bc160b549a0a329ef for chart 1.13.27) that deploy/helm/dagster-values.yaml uses.
# `[]` is an item of a list. A path marked OPEN is one the schema types as a free-form object or as a Kubernetes
# type (Volume, ResourceRequirements, ...) the chart passes through: what is below it is not the chart's to define.
OPEN = True
CHART_1_13_27_KEYS: dict[str, bool] = {
    "global": False,
    "global.postgresqlSecretName": False,
    "postgresql": False,
    "postgresql.enabled": False,
    "postgresql.postgresqlHost": False,
    "postgresql.postgresqlUsername": False,
    "postgresql.postgresqlDatabase": False,
    "postgresql.service": False,
    "postgresql.service.port": False,
    "generatePostgresqlPasswordSecret": False,
    "dagsterWebserver": False,
    "dagsterWebserver.envSecrets": False,
    "dagsterWebserver.envSecrets[]": OPEN,  # SecretEnvSource
    "dagsterDaemon": False,
    "dagsterDaemon.envSecrets": False,
    "dagsterDaemon.envSecrets[]": OPEN,
    "dagsterDaemon.runMonitoring": OPEN,  # type: object
    "dagsterDaemon.runRetries": OPEN,
    "dagster-user-deployments": False,
    "dagster-user-deployments.enabled": False,
    "dagster-user-deployments.enableSubchart": False,
    "dagster-user-deployments.deployments": False,
    "dagster-user-deployments.deployments[]": False,
    "dagster-user-deployments.deployments[].name": False,
    "dagster-user-deployments.deployments[].image": False,
    "dagster-user-deployments.deployments[].image.repository": False,
    "dagster-user-deployments.deployments[].image.tag": False,
    "dagster-user-deployments.deployments[].image.pullPolicy": False,
    "dagster-user-deployments.deployments[].dagsterApiGrpcArgs": False,
    "dagster-user-deployments.deployments[].dagsterApiGrpcArgs[]": False,
    "dagster-user-deployments.deployments[].port": False,
    "dagster-user-deployments.deployments[].includeConfigInLaunchedRuns": False,
    "dagster-user-deployments.deployments[].includeConfigInLaunchedRuns.enabled": False,
    "dagster-user-deployments.deployments[].envConfigMaps": False,
    "dagster-user-deployments.deployments[].envConfigMaps[]": OPEN,  # ConfigMapEnvSource
    "dagster-user-deployments.deployments[].envSecrets": False,
    "dagster-user-deployments.deployments[].envSecrets[]": OPEN,
    "dagster-user-deployments.deployments[].volumes": False,
    "dagster-user-deployments.deployments[].volumes[]": OPEN,  # Volume
    "dagster-user-deployments.deployments[].volumeMounts": False,
    "dagster-user-deployments.deployments[].volumeMounts[]": OPEN,  # VolumeMount
    "dagster-user-deployments.deployments[].podSecurityContext": OPEN,
    "dagster-user-deployments.deployments[].resources": OPEN,  # ResourceRequirements
    "runLauncher": False,
    "runLauncher.type": False,
    "runLauncher.config": False,
    "runLauncher.config.k8sRunLauncher": False,
    "runLauncher.config.k8sRunLauncher.imagePullPolicy": False,
    "runLauncher.config.k8sRunLauncher.loadInclusterConfig": False,
    "runLauncher.config.k8sRunLauncher.envConfigMaps": False,
    "runLauncher.config.k8sRunLauncher.envConfigMaps[]": OPEN,
    "runLauncher.config.k8sRunLauncher.envSecrets": False,
    "runLauncher.config.k8sRunLauncher.envSecrets[]": OPEN,
    "runLauncher.config.k8sRunLauncher.envVars": False,
    "runLauncher.config.k8sRunLauncher.envVars[]": False,
    "runLauncher.config.k8sRunLauncher.volumes": False,
    "runLauncher.config.k8sRunLauncher.volumes[]": OPEN,
    "runLauncher.config.k8sRunLauncher.volumeMounts": False,
    "runLauncher.config.k8sRunLauncher.volumeMounts[]": OPEN,
    "runLauncher.config.k8sRunLauncher.resources": OPEN,
    "computeLogManager": False,
    "computeLogManager.type": False,
    "computeLogManager.config": False,
    "computeLogManager.config.s3ComputeLogManager": False,
    "computeLogManager.config.s3ComputeLogManager.bucket": False,
    "computeLogManager.config.s3ComputeLogManager.prefix": False,
    "telemetry": False,
    "telemetry.enabled": False,
    "additionalInstanceConfig": OPEN,  # type: object, merged into the instance's dagster.yaml
}
# Values the chart's schema restricts to a set (its enums), for the keys above.
CHART_1_13_27_ENUMS = {
    "runLauncher.type": {"CeleryK8sRunLauncher", "K8sRunLauncher", "CustomRunLauncher"},
    "computeLogManager.type": {"NoOpComputeLogManager", "AzureBlobComputeLogManager", "GCSComputeLogManager",
                               "S3ComputeLogManager", "CustomComputeLogManager"},
    "dagster-user-deployments.deployments[].image.pullPolicy": {"Always", "IfNotPresent", "Never"},
    "runLauncher.config.k8sRunLauncher.imagePullPolicy": {"Always", "IfNotPresent", "Never"},
}


def manifests() -> list[Path]:
    return sorted((DEPLOY / "k8s").glob("*.yaml"))


def key_paths(value, path: str = ""):
    """(path, value) of every key and list item under `value`, not descending below OPEN paths."""
    if path and CHART_1_13_27_KEYS.get(path):
        return
    if isinstance(value, dict):
        for key, child in value.items():
            child_path = f"{path}.{key}" if path else key
            yield child_path, child
            yield from key_paths(child, child_path)
    elif isinstance(value, list):
        for child in value:
            yield f"{path}[]", child
            yield from key_paths(child, f"{path}[]")


def test_there_are_manifests_for_every_part():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for path in manifests()
             for doc in yaml.safe_load_all(path.read_text()) if doc}
    for part in [("Deployment", "vllm-qwen3-8b"), ("Deployment", "vllm-router"), ("Role", "vllm-router-pod-reader"),
                 ("Deployment", "batch-api"), ("Service", "batch-api"), ("Secret", "batch-dagster-secrets")]:
        assert part in kinds, part


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        # Raises ValidationError naming the field, for a wrong type, a missing required field or an unknown field.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_catches_an_unknown_field():
    doc = yaml.safe_load((DEPLOY / "k8s" / "api.yaml").read_text().split("\n---\n")[0])
    doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo of `resources`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_fleet_pods_ask_for_a_gpu_and_are_ready_on_health():
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-fleet.yaml").read_text()):
        if doc["kind"] != "Deployment":
            continue
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert any(m["mountPath"] == "/models" for m in container["volumeMounts"])


def test_router_discovers_the_fleet_pods():
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-router.yaml").read_text())}
    command = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--service-discovery" in command
    selector = command[command.index("--selector") + 1:]
    selector = selector[: next(i for i, a in enumerate(selector) if a.startswith("--"))]
    fleet = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-fleet.yaml").read_text())
                 if doc["kind"] == "Deployment")
    labels = fleet["spec"]["template"]["metadata"]["labels"]
    assert selector and all(labels.get(k) == v for k, v in (s.split("=", 1) for s in selector))
    assert {"pods"} <= set(docs["Role"]["rules"][0]["resources"]) and "watch" in docs["Role"]["rules"][0]["verbs"]


def test_helm_values_use_only_keys_the_chart_defines():
    values = yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())
    unknown = [path for path, _ in key_paths(values) if path not in CHART_1_13_27_KEYS]
    assert unknown == [], f"keys the Dagster chart 1.13.27 does not define: {unknown}"
    for path, value in key_paths(values):
        if path in CHART_1_13_27_ENUMS:
            assert value in CHART_1_13_27_ENUMS[path], (path, value)


def test_the_key_check_catches_a_misspelt_key():
    values = yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())
    values["runLauncher"]["config"]["k8sRunLauncher"]["envSecret"] = []
    assert "runLauncher.config.k8sRunLauncher.envSecret" in [p for p, _ in key_paths(values)
                                                              if p not in CHART_1_13_27_KEYS]


def test_helm_values_run_this_projects_code_on_kubernetes():
    values = yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "batch_dagster.definitions"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["computeLogManager"]["type"] == "S3ComputeLogManager"
    env = {m["name"] for m in deployment["envConfigMaps"]} | {s["name"] for s in deployment["envSecrets"]}
    defined = {doc["metadata"]["name"] for path in manifests() for doc in yaml.safe_load_all(path.read_text())
               if doc and doc["kind"] in ("ConfigMap", "Secret")}
    assert env <= defined
