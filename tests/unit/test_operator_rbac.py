"""The operator's RBAC rules: least privilege (no wildcards, no secrets), and every verb the operator uses is granted."""

from __future__ import annotations

import pytest

from trainingrun.operator import rbac


def _all_rules():
    return (rbac.RULES + rbac.PEERING_NAMESPACED_RULES + rbac.PEERING_CLUSTER_RULES)


def test_no_wildcards_and_no_secrets():
    for rule in _all_rules():
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], f"wildcard in {key}: {rule}"
            assert rule[key], f"empty {key}: {rule}"
        assert "secrets" not in rule["resources"], rule
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule


def _granted(rules, group, resource, verb):
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


@pytest.mark.parametrize(
    "group,resource,verb",
    [
        ("trainingrun.dev", "trainingruns", "watch"),
        ("trainingrun.dev", "trainingruns", "delete"),  # ttlSecondsAfterFinished
        ("trainingrun.dev", "trainingruns/status", "patch"),
        ("trainingrun.dev", "trainingruns/finalizers", "update"),  # blockOwnerDeletion (OwnerReferencesPermission...)
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods", "watch"),
        ("", "services", "create"),
        ("", "services", "watch"),  # the children index: missing children are created on every reconcile
        ("", "configmaps", "create"),
        ("", "configmaps", "watch"),
        ("", "configmaps", "patch"),  # a resize updates the run's manifest
        ("scheduling.volcano.sh", "podgroups", "delete"),  # a PodGroup per attempt
        ("scheduling.volcano.sh", "podgroups", "patch"),  # the engines' group resized with the pool
        ("scheduling.k8s.io", "workloads", "patch"),
        ("", "events", "create"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ],
)
def test_operator_verbs_granted(group, resource, verb):
    assert _granted(rbac.RULES, group, resource, verb)


def test_split_namespaced_vs_clusterwide():
    cw = rbac.rules(clusterwide=True, gang=False)
    assert cw["namespaced"] == []
    assert _granted(cw["cluster"], "", "pods", "create")
    ns = rbac.rules(clusterwide=False, gang=False, peering=True)
    assert not _granted(ns["cluster"], "", "pods", "create")  # pods only through namespaced Roles
    assert _granted(ns["namespaced"], "", "pods", "create")
    assert _granted(ns["namespaced"], "kopf.dev", "kopfpeerings", "patch")
    assert _granted(ns["cluster"], "apiextensions.k8s.io", "customresourcedefinitions", "watch")
    assert not _granted(ns["namespaced"] + ns["cluster"], "scheduling.volcano.sh", "podgroups", "create")
