"""The Helm chart, checked with the real tools: Helm SDK lint/render/schema, kubernetes-validate (1.29-1.33, strict),
checkov, and the operator's own RBAC rules and pod labels.

Prometheus-operator objects (ServiceMonitor, PodMonitor, PrometheusRule) have no built-in Kubernetes schema;
they are checked against the small structural JSON schemas below (the fields the Prometheus operator requires and
the ones this chart sets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "trainingrun"
ALL_FEATURES = CHART / "ci" / "all-features-values.yaml"
NAMESPACE = "trainingrun-system"
RELEASE = "tr"
K8S_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
CHECKOV = ROOT / ".venv-tools" / "bin" / "checkov"
REQUIRE = os.environ.get("TRAININGRUN_REQUIRE_SERVICES") == "1"


# ------------------------------------------------------------------------------------------------------- helpers
def all_features_values() -> dict:
    return yaml.safe_load(ALL_FEATURES.read_text())


@lru_cache(maxsize=16)
def _render(values_json: str) -> tuple[dict, ...]:
    values = json.loads(values_json)
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
        crds = [yaml.safe_load(c["data"]) for c in chart.crds]
    docs = []
    for path, text in sorted(out.items()):
        if not path.endswith(".yaml"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(crds + docs)


def render_chart(values: dict | None = None) -> list[dict]:
    """Every manifest the chart installs for `values` (CRDs first), as dicts."""
    return [json.loads(json.dumps(d)) for d in _render(json.dumps(values or {}, sort_keys=True))]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


VALUE_SETS = {"default": {}, "all-features": None}


def values_for(name: str) -> dict:
    return all_features_values() if name == "all-features" else {}


# --------------------------------------------------------------------------------------------- lint and schema
@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_has_no_warnings_or_errors(name):
    report = helm.lint(CHART, values_for(name), strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], f"helm lint: {problems} {report['errors']}"


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"bogus": 1}, ["additional properties 'bogus' not allowed"]),
        ({"operator": {"metricsPort": 0, "livenessPort": 8081}}, ["/operator/metricsPort", "minimum"]),
        ({"operator": {"metricsPort": 9090, "livenessPort": 8080, "interval": 60}}, ["/operator/interval"]),
        ({"image": {"repository": "r", "tag": "1", "digest": "md5:abc", "pullPolicy": "Always"}}, ["/image/digest"]),
        ({"watchNamespaces": ["Bad_NS"]}, ["/watchNamespaces/0"]),
        ({"prometheusRule": {"enabled": True, "noProgressFor": "fifteen minutes"}}, ["/prometheusRule/noProgressFor"]),
        ({"prometheusRule": {"enabled": True, "imbalanceThreshold": 0.5}}, ["/prometheusRule/imbalanceThreshold"]),
        ({"serviceMonitor": {"enabled": "yes"}}, ["/serviceMonitor/enabled"]),
        ({"resources": {"limits": {"memory": "lots"}}}, ["/resources/limits/memory"]),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(values, expected):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as err:
            chart.validate_schema(values)
    for fragment in expected:
        assert fragment in str(err.value), f"{fragment!r} not in error: {err.value}"


def test_latest_tag_is_refused_with_a_clear_error():
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError) as err:
        chart.render({"image": {"tag": "latest"}}, name=RELEASE, namespace=NAMESPACE)
    assert "image.tag" in str(err.value) and "latest" in str(err.value)


def test_default_values_pass_the_schema_and_keep_optional_objects_off():
    kinds = {d["kind"] for d in render_chart()}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
            "Service", "NetworkPolicy"} <= kinds
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "Role"}


# ------------------------------------------------------------------------------------------------------- CRD
def test_chart_crd_is_identical_to_the_generated_crd():
    source = ROOT / "crds" / "trainingrun.yaml"
    copy = CHART / "crds" / "trainingrun.yaml"
    assert copy.read_bytes() == source.read_bytes(), (
        "charts/trainingrun/crds/trainingrun.yaml differs from crds/trainingrun.yaml; refresh with: "
        "cp crds/trainingrun.yaml charts/trainingrun/crds/"
    )
    crd = one(render_chart(), "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "trainingruns.trainingrun.dev"
    assert crd["spec"]["names"]["shortNames"] == ["tr"]


def test_generated_chart_files_are_in_sync():
    """CRD copy, RBAC rules file and dashboards JSON all match their sources."""
    proc = subprocess.run([sys.executable, str(CHART / "sync.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------ kubernetes schemas
_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _monitoring_cr(required: list[str], spec_properties: dict) -> dict:
    """Schema of a prometheus-operator custom resource: the envelope, and a closed `spec`."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {"type": "object", "additionalProperties": False, "required": required,
                     "properties": spec_properties},
        },
    }


def _endpoints(**extra: dict) -> dict:
    """A non-empty list of scrape endpoints, each naming its port."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["port"],
            "properties": {"port": {"type": "string", "minLength": 1}, "path": {"type": "string", "pattern": "^/"},
                           "interval": _DURATION, "scrapeTimeout": _DURATION, **extra},
        },
    }


_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_ALERT_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["alert", "expr"],
    "properties": {
        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*$"},
        "expr": {"type": "string", "minLength": 1},
        "for": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}
MONITORING_SCHEMAS = {
    "ServiceMonitor": _monitoring_cr(["selector", "endpoints"], {
        "selector": {"type": "object", "required": ["matchLabels"]},
        "namespaceSelector": {"type": "object"},
        "endpoints": _endpoints(honorLabels={"type": "boolean"}),
    }),
    "PodMonitor": _monitoring_cr(["selector", "podMetricsEndpoints"], {
        "selector": _LABEL_SELECTOR,
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
        },
        "podMetricsEndpoints": _endpoints(),
    }),
    "PrometheusRule": _monitoring_cr(["groups"], {
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "rules"],
                "properties": {"name": {"type": "string", "minLength": 1},
                               "rules": {"type": "array", "items": _ALERT_RULE}},
            },
        },
    }),
}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_passes_strict_kubernetes_schemas(name):
    kv = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    docs = render_chart(values_for(name))
    checked = set()
    for doc in docs:
        kind = doc["kind"]
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(doc, MONITORING_SCHEMAS[kind])
            checked.add(kind)
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{kind} {doc['metadata']['name']} invalid for Kubernetes {version}: {exc}")
        checked.add(kind)
    if name == "all-features":
        assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "Role", "RoleBinding"} <= checked


def test_structural_schemas_reject_a_broken_monitor():
    """The hand-written schemas above catch real mistakes (so the previous test can fail)."""
    jsonschema = pytest.importorskip("jsonschema")
    monitor = one(render_chart(all_features_values()), "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = monitor["spec"]["podMetricsEndpoints"][0].pop("port")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, MONITORING_SCHEMAS["PodMonitor"])


# ---------------------------------------------------------------------------------------------- the operator pod
@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_deployment_is_hardened(name):
    values = values_for(name)
    deploy = one(render_chart(values), "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] >= 10000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False
    assert container["livenessProbe"]["httpGet"]["port"] == "liveness"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    metrics_port = values.get("operator", {}).get("metricsPort", 9090)
    assert ports["metrics"] == metrics_port
    assert f"--metrics-port={metrics_port}" in container["args"]
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    image = container["image"]
    digest = values.get("image", {}).get("digest")
    assert image.endswith("@" + digest) if digest else image.endswith(":0.1.0")
    assert pod["serviceAccountName"] == one(render_chart(values), "ServiceAccount")["metadata"]["name"]
    if values.get("watchNamespaces"):
        assert [f"--namespace={ns}" for ns in values["watchNamespaces"]] == [
            a for a in container["args"] if a.startswith("--namespace=")
        ]
    else:
        assert "--all-namespaces" in container["args"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_args_parse_with_the_real_operator_cli(name):
    """The container's arguments are accepted by `trainingrun operator`'s own argument parser and mean what the
    values say (ports the probes and the Service use, watched namespaces)."""
    from trainingrun.cli import build_parser

    values = values_for(name)
    container = one(render_chart(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "operator"
    parsed = build_parser(args).parse_args(args)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert parsed.metrics_port == ports["metrics"] and parsed.liveness_port == ports["liveness"]
    assert parsed.namespace == values.get("watchNamespaces", [])
    assert parsed.peering is None and parsed.bind == "0.0.0.0"


def test_standard_labels_on_every_chart_object():
    for doc in render_chart(all_features_values()):
        if doc["kind"] == "CustomResourceDefinition":
            continue
        labels = doc["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert labels.get(key), f"{doc['kind']} {doc['metadata']['name']} lacks label {key}"


def test_metrics_service_selects_the_operator_pod_by_port_name():
    docs = render_chart()
    service = one(docs, "Service")
    pod = one(docs, "Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


# ----------------------------------------------------------------------------------------------------- RBAC
def _rules_by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole"):
            out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.mark.parametrize("watch, gang", [([], True), ([], False), (["research", "prod"], True), (["research"], False)])
def test_rbac_equals_the_operators_rules(watch, gang):
    from trainingrun.operator import rbac

    docs = render_chart({"watchNamespaces": watch, "rbac": {"create": True, "gangScheduling": gang}})
    expected = rbac.rules(clusterwide=not watch, gang=gang)
    roles = _rules_by_kind(docs)
    (cluster_role,) = roles["ClusterRole"]
    assert cluster_role["rules"] == expected["cluster"]
    if watch:
        assert sorted(r["metadata"]["namespace"] for r in roles["Role"]) == sorted(watch)
        for role in roles["Role"]:
            assert role["rules"] == expected["namespaced"]
        bindings = of_kind(docs, "RoleBinding")
        assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watch)
    else:
        assert "Role" not in roles and not expected["namespaced"]
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    for binding in of_kind(docs, "RoleBinding") + of_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rbac_has_no_wildcards_and_no_secrets(name):
    roles = [r for rs in _rules_by_kind(render_chart(values_for(name))).values() for r in rs]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
            assert not any(r == "secrets" or r.startswith("secrets/") for r in rule["resources"]), rule
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            assert "nonResourceURLs" not in rule


def test_rbac_can_be_turned_off():
    assert not _rules_by_kind(render_chart({"rbac": {"create": False, "gangScheduling": True}}))


# ------------------------------------------------------------------------------------------ monitors and dashboards
def _matches(selector: dict, labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        present = expr["key"] in labels
        value = labels.get(expr["key"])
        ok = {
            "In": present and value in expr.get("values", []),
            "NotIn": not present or value not in expr.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[expr["operator"]]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("include_rollout", [True, False])
def test_pod_monitor_selects_the_operators_run_pods(include_rollout):
    """The PodMonitor's selector and port name fit the pods the operator really renders for examples/tiny.yaml."""
    from trainingrun.api import load_trainingrun
    from trainingrun.operator import render, vocabulary

    run = load_trainingrun(ROOT / "examples" / "tiny.yaml")
    pods = render.render_pods(run, vocabulary.Owner(name=run.metadata.name, namespace="research", uid="u-1"), 0)
    values = {**all_features_values()}
    values["podMonitor"] = {**values["podMonitor"], "includeRollout": include_rollout}
    monitor = one(render_chart(values), "PodMonitor")
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    roles = set()
    for pod in pods:
        labels = pod["metadata"]["labels"]
        selected = _matches(monitor["spec"]["selector"], labels)
        role = labels["trainingrun.dev/role"]
        assert selected == (role == "trainer" or (include_rollout and role == "rollout")), labels
        if selected:
            roles.add(role)
            assert port in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert "trainer" in roles
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": values["watchNamespaces"]}


def test_pod_monitor_scrapes_every_worker_of_a_multi_gpu_trainer_pod():
    """gpusPerReplica = 8: each of the 8 workers' metrics ports, as the operator declares them, is an endpoint."""
    import copy

    from trainingrun.api import parse_trainingrun
    from trainingrun.operator import render, vocabulary

    doc = yaml.safe_load((ROOT / "examples" / "gpu-8x.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["spec"]["trainer"].update(replicas=1, gpusPerReplica=8)
    run = parse_trainingrun(doc)
    pods = render.render_pods(run, vocabulary.Owner(name=run.metadata.name, namespace="ml", uid="u-1"), 0)
    trainer = next(p for p in pods if p["metadata"]["labels"]["trainingrun.dev/role"] == "trainer")
    declared = {p["name"] for p in trainer["spec"]["containers"][0]["ports"] if p["name"].startswith("metrics")}
    assert len(declared) == 8
    monitor = one(render_chart(all_features_values()), "PodMonitor")
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert declared <= scraped


def test_dashboard_config_maps_carry_the_dashboards_for_the_sidecar():
    values = all_features_values()
    maps = of_kind(render_chart(values), "ConfigMap")
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(k for m in maps for k in m["data"]) == files
    for cm in maps:
        assert cm["metadata"]["labels"][values["dashboards"]["label"]] == values["dashboards"]["labelValue"]
        assert cm["metadata"]["namespace"] == values["dashboards"]["namespace"]
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / name).read_text())


def test_dashboard_label_is_configurable():
    values = {"dashboards": {"enabled": True, "label": "grafana.io/dashboard", "labelValue": "trainingrun"}}
    for cm in of_kind(render_chart(values), "ConfigMap"):
        assert cm["metadata"]["labels"]["grafana.io/dashboard"] == "trainingrun"
        assert cm["metadata"]["namespace"] == NAMESPACE


# ---------------------------------------------------------------------------------------------------- checkov
def _checkov() -> str:
    if CHECKOV.exists():
        return str(CHECKOV)
    message = f"{CHECKOV.relative_to(ROOT)} is missing (run `make tools`); required in CI"
    if REQUIRE:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_checkov_finds_no_failed_check_and_every_skip_has_a_reason(name, tmp_path):
    checkov = _checkov()
    docs = render_chart(values_for(name))
    for i, doc in enumerate(docs):
        (tmp_path / f"{i:02d}-{doc['kind'].lower()}.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [checkov, "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.stdout.strip(), f"checkov printed nothing: {proc.stderr[-2000:]}"
    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, f"checkov failed checks: {failed}"
    passed = sum(r["summary"]["passed"] for r in reports)
    assert passed > 50, f"checkov passed only {passed} checks: did it scan the manifests?"
    skipped = [c for r in reports for c in r["results"]["skipped_checks"]]
    annotated = {}
    for doc in docs:
        for key, text in doc["metadata"].get("annotations", {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = text.partition("=")
                annotated[check] = reason
    for check in skipped:
        assert len(annotated.get(check["check_id"], "")) > 20, f"skip of {check['check_id']} has no reason"


def test_install_doc_lists_every_value():
    """docs/install.md's values table names every leaf key of values.yaml."""
    doc = (ROOT / "docs" / "install.md").read_text()

    def leaves(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key != "resources":
                yield from leaves(value, path + ".")
            else:
                yield path

    missing = [k for k in leaves(yaml.safe_load((CHART / "values.yaml").read_text())) if f"`{k}`" not in doc]
    assert not missing, f"docs/install.md lacks values: {missing}"
