"""deploy/'s monitoring and autoscaling checked without a cluster: every pod that has metrics is scraped on a port it
opens, the scrape configurations and the dashboard's expressions pass promtool (when Debian's `prometheus` package
is installed), the KEDA ScaledObjects use only keys KEDA defines and follow a fleet's queue metric that the API
exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.core.test_deploy import DEPLOY, WORKLOADS, documents

DASHBOARD = DEPLOY / "grafana" / "batch-dagster.json"
# What the dashboard's template variables and Grafana's interval stand for, when its expressions run outside Grafana.
GRAFANA_VARIABLES = {"$model": ".*", "$key": ".*", "$__rate_interval": "1m"}

# Key paths of KEDA's ScaledObject (keda.sh/v1alpha1, kedacore/keda config/crd/bases/keda.sh_scaledobjects.yaml, 2.x)
# and of its Prometheus scaler's metadata (keda.sh/docs/2.13/scalers/prometheus) that deploy/autoscaling uses. The
# trigger's `metadata` is a free map of strings to KEDA's schema: the scaler's own keys are listed here.
KEDA_SCALED_OBJECT_KEYS = {
    "apiVersion", "kind", "metadata", "metadata.name", "metadata.namespace", "metadata.labels", "spec",
    "spec.scaleTargetRef", "spec.scaleTargetRef.apiVersion", "spec.scaleTargetRef.kind", "spec.scaleTargetRef.name",
    "spec.minReplicaCount", "spec.maxReplicaCount", "spec.pollingInterval", "spec.cooldownPeriod", "spec.triggers",
    "spec.triggers[]", "spec.triggers[].type", "spec.triggers[].metadata",
}
KEDA_PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "ignoreNullValues",
                            "namespace", "customHeaders", "unsafeSsl", "queryParameters"}
KEDA_INTEGERS = {"spec.minReplicaCount", "spec.maxReplicaCount", "spec.pollingInterval", "spec.cooldownPeriod"}


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard's panels, its Grafana variables filled in."""
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
             for target in panel.get("targets", [])]
    for name, value in GRAFANA_VARIABLES.items():
        exprs = [e.replace(name, value) for e in exprs]
    return exprs


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is absent (Debian's `prometheus` package: apt-get install -y prometheus)")
    return path


def test_every_pod_with_metrics_is_scraped_on_a_port_it_opens():
    components = {}
    for doc in documents():
        if doc["kind"] not in WORKLOADS:
            continue
        template = doc["spec"]["template"]
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        components[doc["metadata"]["name"]] = component
        if component not in ("api", "vllm-router", "vllm-worker"):  # the only ones with /metrics
            continue
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", doc["metadata"]["name"]
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert int(annotations["prometheus.io/port"]) in ports, doc["metadata"]["name"]
    assert {"api", "vllm-router", "vllm-worker"} <= set(components.values())


def test_the_apis_metrics_are_on_a_port_its_service_does_not_expose():
    """The API's metrics name every key: the pods are scraped on a port of their own, which an Ingress in front of the
    Service never reaches."""
    (api,) = [doc for doc in documents() if doc["kind"] in WORKLOADS
              and doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "api"]
    scraped = int(api["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    (container,) = api["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert scraped != named["http"] and "--metrics-port" in container["command"]
    assert container["command"][container["command"].index("--metrics-port") + 1] == str(scraped)
    services = [doc for doc in documents() if doc["kind"] == "Service"
                and doc["spec"].get("selector", {}).get("app.kubernetes.io/component") == "api"]
    assert services and all({named.get(p["targetPort"], p["targetPort"]) for p in s["spec"]["ports"]} == {named["http"]}
                            for s in services)


def test_the_scrape_configurations_are_valid(tmp_path):
    tool = promtool()
    (config,) = [doc for doc in documents() if doc["kind"] == "ConfigMap"
                 and doc["metadata"]["name"] == "batch-dagster-prometheus"]
    kubernetes = yaml.safe_load(config["data"]["prometheus.yml"])
    (job,) = kubernetes["scrape_configs"]
    (sd,) = job.pop("kubernetes_sd_configs")
    # Debian's Prometheus is built without Kubernetes discovery: its keys are checked here, the rest by promtool.
    assert sd == {"role": "pod", "namespaces": {"names": ["batch-dagster"]}}
    assert {r.get("target_label") for r in job["relabel_configs"]} >= {"component", "model", "pod", "__address__"}
    job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    (tmp_path / "kubernetes.yml").write_text(yaml.safe_dump(kubernetes))
    for path in (tmp_path / "kubernetes.yml", DEPLOY / "prometheus" / "serve.yml"):
        result = subprocess.run([tool, "check", "config", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_expression_is_valid_promql(tmp_path):
    tool = promtool()
    exprs = dashboard_expressions()
    assert len(exprs) >= 15
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([tool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def keda_objects() -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / "autoscaling" / "keda.yaml").read_text()) if doc]


def _paths(value, path: str = ""):
    if path == "spec.triggers[].metadata":
        return
    if isinstance(value, dict):
        for key, child in value.items():
            child_path = f"{path}.{key}" if path else key
            yield child_path, child
            yield from _paths(child, child_path)
    elif isinstance(value, list):
        for child in value:
            yield f"{path}[]", child
            yield from _paths(child, f"{path}[]")


def test_each_fleet_follows_its_models_queue_with_a_keda_scaled_object():
    fleets = {doc["metadata"]["name"]: doc["metadata"]["labels"]["batch-dagster/model"] for doc in documents()
              if doc["kind"] == "StatefulSet"}
    followed = {}
    for doc in keda_objects():
        assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
        unknown = [p for p, _ in _paths(doc) if p not in KEDA_SCALED_OBJECT_KEYS and not p.startswith("metadata.labels.")]
        assert unknown == [], f"keys KEDA's ScaledObject does not define: {unknown}"
        for path, value in _paths(doc):
            if path in KEDA_INTEGERS:
                assert isinstance(value, int) and value >= 0, path
        target = doc["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet") and target["name"] in fleets
        (trigger,) = doc["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and set(trigger["metadata"]) <= KEDA_PROMETHEUS_METADATA
        assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA's metadata is a map of strings
        query = trigger["metadata"]["query"]
        assert "batch_dagster_unfinished_batches" in query
        assert re.search(r'model="([^"]+)"', query).group(1) == fleets[target["name"]]  # its own model's queue
        assert 0 < doc["spec"]["minReplicaCount"] <= doc["spec"]["maxReplicaCount"]
        followed[target["name"]] = query
    assert set(followed) == set(fleets)


def test_the_checks_catch_a_misspelt_keda_key():
    doc = keda_objects()[0]
    doc["spec"]["minReplicas"] = 1  # the HPA's name, not KEDA's
    assert "spec.minReplicas" in [p for p, _ in _paths(doc) if p not in KEDA_SCALED_OBJECT_KEYS]


def keda_queries() -> list[str]:
    """The autoscaler's queries (the system test runs them against a real Prometheus)."""
    return [doc["spec"]["triggers"][0]["metadata"]["query"] for doc in keda_objects()]

