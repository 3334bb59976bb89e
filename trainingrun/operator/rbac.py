"""The exact RBAC rules the operator needs: one list, rendered by the Helm chart into its (Cluster)Role and checked by
a test (no wildcards, no secrets).

Each rule is a plain dict as in a Kubernetes PolicyRule (apiGroups / resources / verbs). Why each is needed:

- trainingruns: kopf watches them (list, watch), patches its own annotations/finalizers (patch) and the operator
  deletes finished runs for `ttlSecondsAfterFinished` (delete); `trainingruns/status` is where the status is written.
- trainingruns/finalizers (update): every child carries an owner reference with `blockOwnerDeletion: true`; with the
  OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) creating such a child needs `update` on the
  owner's finalizers, or every create is refused with 403.
- pods: the rollout, trainer and managed-store pods are created and deleted by the operator (restarts, suspend,
  terminal clean-up) and watched (with a label selector) to observe their phases, exit codes and disruptions; with
  `spec.queueName` a pod is annotated before it is deleted (patch: Kueue's retriable-in-group).
- services, configmaps: the headless rendezvous service, the managed store's service and the run's config are watched
  (with a label selector: every reconcile creates whichever is missing) and created; the ConfigMap is patched when
  the run's spec changes (a resize). They are garbage-collected with the run through their owner references.
- events: kopf posts Kubernetes Events on the TrainingRun for every lifecycle change.
- customresourcedefinitions, namespaces: kopf's discovery of served resources and of the namespaces it watches.
- podgroups (and, for Kubernetes' own gang scheduling, workloads of scheduling.k8s.io): only with
  `spec.gangScheduling.enabled` (Volcano, scheduler-plugins' coscheduling, or provider kubernetes): one per attempt,
  created, and deleted when the attempt ends; the engines' serving group is patched to the pool's new size when
  `spec.rollout.engine.replicas` changes (a resize). Discovery of the served scheduling.k8s.io version needs no rule (every
  authenticated client may read discovery).
- kopf.dev peerings: only when the operator runs with `--peering` (HA, see docs/operator.md); the default is
  `--standalone` with one replica.

Trainer and rollout pods need no Kubernetes API permission at all: progress travels through the run's store (see
`trainingrun.operator.progress`), so their service account can have `automountServiceAccountToken: false`.
"""

from __future__ import annotations

from typing import Any

Rule = dict[str, list[str]]

# Namespaced resources: a Role in each watched namespace, or part of the ClusterRole when cluster-wide.
NAMESPACED_RULES: tuple[Rule, ...] = (
    {"apiGroups": ["trainingrun.dev"], "resources": ["trainingruns"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    {"apiGroups": ["trainingrun.dev"], "resources": ["trainingruns/status"], "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["trainingrun.dev"], "resources": ["trainingruns/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete", "patch"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch", "create"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
)

# Cluster-scoped resources kopf reads: always in a ClusterRole.
CLUSTER_RULES: tuple[Rule, ...] = (
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
)

# Only with gang scheduling (spec.gangScheduling.enabled).
GANG_RULES: tuple[Rule, ...] = (
    {"apiGroups": ["scheduling.volcano.sh"], "resources": ["podgroups"], "verbs": ["get", "create", "delete", "patch"]},
    {"apiGroups": ["scheduling.x-k8s.io"], "resources": ["podgroups"], "verbs": ["get", "create", "delete", "patch"]},
    {"apiGroups": ["scheduling.k8s.io"], "resources": ["workloads", "podgroups"], "verbs": ["get", "create", "delete", "patch"]},
)

# Only with --peering (several replicas; one active). ClusterKopfPeering is cluster-scoped.
PEERING_NAMESPACED_RULES: tuple[Rule, ...] = (
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
)
PEERING_CLUSTER_RULES: tuple[Rule, ...] = (
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
)

# Everything a cluster-wide operator with gang scheduling needs (peering excluded: standalone is the default).
RULES: tuple[Rule, ...] = NAMESPACED_RULES + CLUSTER_RULES + GANG_RULES


def rules(*, clusterwide: bool = True, gang: bool = True, peering: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The rules split by where they go: {"cluster": [...ClusterRole rules], "namespaced": [...Role rules]}.

    Cluster-wide, everything goes into the ClusterRole; namespaced, the namespaced rules go into a Role in each watched
    namespace and only the cluster-scoped ones into the ClusterRole.
    """
    namespaced = list(NAMESPACED_RULES) + (list(GANG_RULES) if gang else [])
    namespaced += list(PEERING_NAMESPACED_RULES) if peering and not clusterwide else []
    cluster = list(CLUSTER_RULES) + (list(PEERING_CLUSTER_RULES) if peering and clusterwide else [])
    if clusterwide:
        return {"cluster": [dict(r) for r in cluster + namespaced], "namespaced": []}
    return {"cluster": [dict(r) for r in cluster], "namespaced": [dict(r) for r in namespaced]}
