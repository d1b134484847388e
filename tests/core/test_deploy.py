"""deploy/ checked without a cluster: every manifest against the Kubernetes schemas, the Helm values against the
keys the Dagster chart defines, and the storage layout: every pod of this project's code names the same batch storage
and keeps only scratch of its own; no pod shares a volume with another."""

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
    "dagsterDaemon.runCoordinator": False,
    "dagsterDaemon.runCoordinator.enabled": False,
    "dagsterDaemon.runCoordinator.type": False,
    "dagsterDaemon.runCoordinator.config": False,
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator": False,
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.tagConcurrencyLimits": False,
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.tagConcurrencyLimits[]": False,
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.tagConcurrencyLimits[].key": False,
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.tagConcurrencyLimits[].value": False,  # text, or:
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.tagConcurrencyLimits[].value.applyLimitPerUniqueValue":
        False,
    "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.tagConcurrencyLimits[].limit": False,
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
    "dagsterDaemon.runCoordinator.type": {"QueuedRunCoordinator", "CustomRunCoordinator"},
    "runLauncher.type": {"CeleryK8sRunLauncher", "K8sRunLauncher", "CustomRunLauncher"},
    "computeLogManager.type": {"NoOpComputeLogManager", "AzureBlobComputeLogManager", "GCSComputeLogManager",
                               "S3ComputeLogManager", "CustomComputeLogManager"},
    "dagster-user-deployments.deployments[].image.pullPolicy": {"Always", "IfNotPresent", "Never"},
    "runLauncher.config.k8sRunLauncher.imagePullPolicy": {"Always", "IfNotPresent", "Never"},
}


ENV_CONFIG_MAP = "batch-dagster-env"  # the environment every pod of this project's code reads
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def manifests() -> list[Path]:
    return sorted((DEPLOY / "k8s").glob("*.yaml"))


def documents() -> list[dict]:
    return [doc for path in manifests() for doc in yaml.safe_load_all(path.read_text()) if doc]


def helm_values() -> dict:
    return yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())


def env_config(docs: list[dict]) -> dict[str, str]:
    (config,) = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == ENV_CONFIG_MAP]
    return config["data"]


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod the manifests define, by kind/name: its spec (CronJobs included)."""
    pods = {}
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in WORKLOADS:
            pods[name] = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "CronJob":
            pods[name] = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return pods


def runs_this_projects_code(container: dict) -> bool:
    """A container of this project's image that is not a vLLM server: it reads batch folders."""
    return (container["image"].split(":")[0].endswith("/batch-dagster")
            and container.get("command", [])[:2] != ["batch-dagster", "vllm-server"])


def helm_pods(values: dict) -> dict[str, dict]:
    """The pods the Helm values shape for this project's code, in the chart's words: the code server (the user
    deployment; it evaluates the daemon's sensors and schedule) and every run pod (the K8s run launcher)."""
    (code,) = values["dagster-user-deployments"]["deployments"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    return {"code server": {"config_maps": [m["name"] for m in code.get("envConfigMaps", [])],
                            "env": [e["name"] for e in code.get("env") or []],
                            "volumes": code.get("volumes", []), "mounts": code.get("volumeMounts", [])},
            "run pods": {"config_maps": [m["name"] for m in launcher.get("envConfigMaps", [])],
                         "env": [e.split("=", 1)[0] for e in launcher.get("envVars") or []],
                         "volumes": launcher.get("volumes", []), "mounts": launcher.get("volumeMounts", [])}}


def is_scratch(volume: dict) -> bool:
    """A volume that lives and dies with its pod, bounded: an emptyDir with a size limit, or a generic ephemeral
    volume (a claim made for the pod and deleted with it)."""
    if "emptyDir" in volume:
        return bool(volume["emptyDir"].get("sizeLimit"))
    return "ephemeral" in volume


def project_pods(docs: list[dict], values: dict) -> dict[str, dict]:
    """Every pod that runs this project's code: the manifests' (the API) and the Helm values' (code server, runs)."""
    pods = {}
    for name, spec in pod_specs(docs).items():
        for container in spec["containers"]:
            if runs_this_projects_code(container):
                pods[name] = {"config_maps": [s["configMapRef"]["name"] for s in container.get("envFrom", [])
                                              if "configMapRef" in s and not s["configMapRef"].get("optional")],
                              "env": [e["name"] for e in container.get("env", [])],
                              "volumes": spec.get("volumes", []), "mounts": container.get("volumeMounts", [])}
    return pods | helm_pods(values)


def storage_problems(docs: list[dict], values: dict) -> list[str]:
    """Where a pod of this project's code would not name the one batch storage, or would keep more than scratch."""
    problems = []
    defining = {doc["metadata"]["name"] for doc in docs if doc["kind"] in ("ConfigMap", "Secret")
                and "BATCH_STORAGE_URL" in {**doc.get("data", {}), **doc.get("stringData", {})}}
    if defining != {ENV_CONFIG_MAP}:
        problems.append(f"BATCH_STORAGE_URL is set in {sorted(defining)}, not in {ENV_CONFIG_MAP} alone")
    data_dir = env_config(docs)["BATCH_DATA_DIR"]
    for name, pod in project_pods(docs, values).items():
        if ENV_CONFIG_MAP not in pod["config_maps"]:
            problems.append(f"{name}: no envFrom {ENV_CONFIG_MAP}")
        if {"BATCH_STORAGE_URL", "BATCH_DATA_DIR"} & set(pod["env"]):
            problems.append(f"{name}: overrides the storage variables")
        mounts = [m["name"] for m in pod["mounts"] if m["mountPath"] == data_dir]
        volumes = [v for v in pod["volumes"] if v["name"] in mounts]
        if len(volumes) != 1 or not is_scratch(volumes[0]):
            problems.append(f"{name}: BATCH_DATA_DIR ({data_dir}) is not a scratch volume of its own: {volumes}")
    return problems


def sharing_problems(docs: list[dict], values: dict) -> list[str]:
    """Claims that more than one node may mount (ReadWriteMany), and volumes that more than one pod mounts."""
    claims = {}  # every claim the manifests make, by name: its access modes
    for doc in docs:
        if doc["kind"] == "PersistentVolumeClaim":
            claims[doc["metadata"]["name"]] = doc["spec"]["accessModes"]
        if doc["kind"] == "StatefulSet":  # one claim per replica
            claims |= {t["metadata"]["name"]: t["spec"]["accessModes"] for t in doc["spec"].get("volumeClaimTemplates", [])}
    problems = [f"claim {name} is ReadWriteMany" for name, modes in claims.items() if "ReadWriteMany" in modes]
    replicas = {f"{doc['kind']}/{doc['metadata']['name']}": doc["spec"].get("replicas", 1) for doc in docs
                if doc["kind"] in WORKLOADS}
    pods = {name: spec.get("volumes", []) for name, spec in pod_specs(docs).items()}
    helm = {name: pod["volumes"] for name, pod in helm_pods(values).items()}
    mounted: dict[str, int] = {}  # pods mounting each claim
    for name, volumes in (pods | helm).items():
        for volume in volumes:
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim:
                mounted[claim] = mounted.get(claim, 0) + replicas.get(name, 2)  # run pods: any number
            if claim and (claim not in claims or name in helm):
                # Run pods and the code server keep nothing: a claim there pins every run to one volume.
                problems.append(f"{name} mounts the claim {claim}")
            ephemeral = volume.get("ephemeral", {}).get("volumeClaimTemplate", {}).get("spec", {})
            if "ReadWriteMany" in ephemeral.get("accessModes", []):
                problems.append(f"{name}: ephemeral volume {volume['name']} is ReadWriteMany")
            if {"nfs", "cephfs", "glusterfs", "azureFile"} & set(volume):
                problems.append(f"{name}: shared filesystem {volume['name']}")
    problems += [f"claim {claim} is mounted by {count} pods" for claim, count in mounted.items() if count > 1]
    return problems


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
    for part in [("StatefulSet", "vllm-qwen3-8b"), ("Deployment", "vllm-router-qwen3-8b"),
                 ("StatefulSet", "vllm-bge-m3"), ("Deployment", "vllm-router-bge-m3"),
                 ("Role", "vllm-router-pod-reader"), ("Deployment", "batch-api"), ("Service", "batch-api"),
                 ("Secret", "batch-dagster-secrets"), ("ConfigMap", "batch-dagster-prometheus")]:
        assert part in kinds, part


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        # Raises ValidationError naming the field, for a wrong type, a missing required field or an unknown field.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_catches_an_unknown_field():
    doc = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "api.yaml").read_text()) if doc["kind"] == "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo of `resources`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_fleet_pods_ask_for_a_gpu_and_are_ready_on_health():
    fleets = [doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-fleet.yaml").read_text())
              if doc["kind"] in WORKLOADS]
    assert fleets
    for doc in fleets:
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        # The model cache: each replica's own claim, kept across restarts (a StatefulSet's volume claim template).
        (cache,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        claims = {t["metadata"]["name"]: t["spec"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        assert claims[cache]["accessModes"] == ["ReadWriteOnce"]


def test_each_fleet_pod_asks_for_the_gpus_its_models_parallelism_takes():
    """A pod's vLLM server runs its model on tensor_parallel_size (times pipeline_parallel_size) GPUs: the registry in
    config.yaml and the pod's GPU limit must say the same, or the server fails to start or leaves GPUs idle."""
    import tomllib

    from batch_dagster.batchfile.registry import parse_registry

    config = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "config.yaml").read_text())
                  if doc["metadata"]["name"] == "batch-dagster-models")
    registry = parse_registry(tomllib.loads(config["data"]["models.toml"]))
    fleets = [doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-fleet.yaml").read_text())
              if doc["kind"] in WORKLOADS]
    for doc in fleets:
        spec = registry[doc["metadata"]["labels"]["batch-dagster/model"]]
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        gpus = spec.tensor_parallel_size * int(spec.engine_args.get("pipeline_parallel_size", 1))
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus, doc["metadata"]["name"]


def _selector(command: list[str]) -> dict[str, str]:
    """The labels a vllm-router's --selector names."""
    words = command[command.index("--selector") + 1:]
    words = words[: next((i for i, a in enumerate(words) if a.startswith("--")), len(words))]
    return dict(w.split("=", 1) for w in words)


def test_each_model_has_its_fleet_and_its_router_which_finds_only_its_pods_and_the_runs_find_it():
    """Every registry model has a StatefulSet and a vllm-router of its own, whose service discovery selects that
    fleet's pods and no other's; BATCH_FLEET_URLS sends each model to its router's Service."""
    import tomllib

    from batch_dagster.settings import parse_fleet_urls

    router_docs = [doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-router.yaml").read_text()) if doc]
    fleets = {doc["metadata"]["labels"]["batch-dagster/model"]: doc["spec"]["template"]["metadata"]["labels"]
              for doc in yaml.safe_load_all((DEPLOY / "k8s" / "vllm-fleet.yaml").read_text())
              if doc["kind"] in WORKLOADS}
    config = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "config.yaml").read_text())
                  if doc["metadata"]["name"] == "batch-dagster-models")
    assert set(fleets) == set(tomllib.loads(config["data"]["models.toml"])["models"])
    services = {doc["metadata"]["name"]: doc["spec"]["selector"] for doc in router_docs if doc["kind"] == "Service"}
    routers = {}
    for doc in router_docs:
        if doc["kind"] != "Deployment":
            continue
        command = doc["spec"]["template"]["spec"]["containers"][0]["command"]
        assert "--service-discovery" in command
        selected = [model for model, labels in fleets.items()
                    if all(labels.get(k) == v for k, v in _selector(command).items())]
        assert len(selected) == 1, (doc["metadata"]["name"], selected)  # its own model's pods, no other's
        pod_labels = doc["spec"]["template"]["metadata"]["labels"]
        (service,) = [name for name, sel in services.items() if all(pod_labels.get(k) == v for k, v in sel.items())]
        routers[selected[0]] = f"http://{service}.batch-dagster.svc:8000"
    assert parse_fleet_urls(env_config(documents())["BATCH_FLEET_URLS"]) == routers and set(routers) == set(fleets)
    role = next(doc for doc in router_docs if doc["kind"] == "Role")
    assert {"pods"} <= set(role["rules"][0]["resources"]) and "watch" in role["rules"][0]["verbs"]


def test_every_pod_of_this_projects_code_names_the_same_batch_storage():
    docs = documents()
    url = env_config(docs)["BATCH_STORAGE_URL"]
    assert url.startswith("s3://") and "/" in url[len("s3://"):], url  # a bucket and a prefix
    assert {"Deployment/batch-api", "code server", "run pods"} <= set(project_pods(docs, helm_values()))
    assert storage_problems(docs, helm_values()) == []


def test_no_pod_mounts_a_shared_volume():
    assert sharing_problems(documents(), helm_values()) == []


def test_the_storage_checks_catch_a_shared_volume_and_a_pod_without_the_storage():
    docs, values = documents(), helm_values()
    # The layout before S3: a ReadWriteMany claim mounted as BATCH_DATA_DIR by the API and the run pods.
    docs.append({"kind": "PersistentVolumeClaim", "metadata": {"name": "batch-data"},
                 "spec": {"accessModes": ["ReadWriteMany"]}})
    api = pod_specs(docs)["Deployment/batch-api"]
    api["volumes"] = [{"name": "scratch", "persistentVolumeClaim": {"claimName": "batch-data"}}
                      if v["name"] == "scratch" else v for v in api["volumes"]]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    launcher["volumes"] = [{"name": "scratch", "persistentVolumeClaim": {"claimName": "batch-data"}}
                           if v["name"] == "scratch" else v for v in launcher["volumes"]]
    # A code server that reads its BATCH_* from elsewhere.
    values["dagster-user-deployments"]["deployments"][0]["envConfigMaps"] = []
    sharing = sharing_problems(docs, values)
    assert {"claim batch-data is ReadWriteMany", "run pods mounts the claim batch-data"} <= set(sharing)
    assert any(p.startswith("claim batch-data is mounted by") for p in sharing)
    storage = storage_problems(docs, values)
    assert "code server: no envFrom batch-dagster-env" in storage
    assert {p.split(":")[0] for p in storage if "not a scratch volume" in p} == {"Deployment/batch-api", "run pods"}



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


def test_helm_values_bound_runs_as_the_repos_dagster_yaml_does():
    values = yaml.safe_load((DEPLOY / "helm" / "dagster-values.yaml").read_text())
    coordinator = values["dagsterDaemon"]["runCoordinator"]
    assert coordinator["enabled"] and coordinator["type"] == "QueuedRunCoordinator"
    instance = yaml.safe_load((REPO / "batch_dagster" / "config" / "dagster.yaml").read_text())
    assert coordinator["config"]["queuedRunCoordinator"]["tagConcurrencyLimits"] == \
        instance["concurrency"]["runs"]["tag_concurrency_limits"]
    # The chart refuses run limits in both places; and no pool is left to bound the inference step.
    assert "concurrency" not in values.get("additionalInstanceConfig", {})
