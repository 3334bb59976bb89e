"""The identity of the TrainingRun API and the names its objects carry: one place, used by the CRD generator, the
operator's renderers and status code, the local launcher and the tests (in the manner of JobSet's
`jobset_types.go`). Values marked *contract* are relied on outside the test suite (design.md): never change them.

API identity
  GROUP         "trainingrun.dev"                 (contract) the API group
  VERSION       "v1alpha1"                        (contract) the version within the group
  API_VERSION   "trainingrun.dev/v1alpha1"        the `apiVersion` field of a manifest: GROUP/VERSION
  KIND          "TrainingRun"                     (contract)
  PLURAL        "trainingruns"                    (contract) the resource name in URLs and RBAC rules
  SHORT_NAME    "tr"                              (contract) `kubectl get tr`

Labels of every child object (pods also carry LABEL_ROLE; trainers LABEL_RANK; rollout/trainer pods LABEL_ATTEMPT):
  LABEL_NAME    "app.kubernetes.io/name" = APP    (contract)
  LABEL_RUN     "trainingrun.dev/run" = <run>     (contract)
  LABEL_ROLE    "trainingrun.dev/role"            (contract) rollout | trainer | store | config | engine
  LABEL_RANK    "trainingrun.dev/rank"            (contract) trainer node rank
  LABEL_ATTEMPT "trainingrun.dev/attempt"         the restart attempt the pod belongs to
  LABEL_ROLE_ATTEMPT "trainingrun.dev/role-attempt"  rollout and engine pods: their generation within the role (one
                                                  more for each restart of the role alone; 0 when absent)
  LABEL_REPLICA "trainingrun.dev/replica"         engine pods: the replica index
  LABEL_ENGINE_REPLICA "trainingrun.dev/engine-replica"  (contract) engine pods: the replica index (as LABEL_REPLICA)
  LABEL_ENGINE_NODE "trainingrun.dev/engine-node"  (contract) engine pods: the pod's node within its replica (0 = the
                                                  leader, serving the replica's URL; rollout.engine.vllm.nodes)

Annotations and other names the operator writes on a TrainingRun:
  ANNOTATION_SPEC  the spec frozen at the first reconcile
  ANNOTATION_CONFIG_HASH  on the run's ConfigMap: a hash of the manifest it holds (a resize changes it)
  FINALIZER        kopf's finalizer on every TrainingRun it handles (docs/operator.md: removing it by hand)
  MANAGED_BY_OPERATOR  spec.managedBy naming this operator (unset means the same); any other value: another
                   controller (e.g. MultiKueue) runs the run and the operator leaves it alone
  EVENT_SOURCE     source.component / reportingComponent of the operator's Events
"""

from __future__ import annotations

from typing import Final

GROUP: Final = "trainingrun.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "TrainingRun"
LIST_KIND: Final = f"{KIND}List"
PLURAL: Final = "trainingruns"
SINGULAR: Final = "trainingrun"
SHORT_NAME: Final = "tr"
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

APP: Final = "trainingrun"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_RUN: Final = f"{GROUP}/run"
LABEL_ROLE: Final = f"{GROUP}/role"
LABEL_RANK: Final = f"{GROUP}/rank"
LABEL_ATTEMPT: Final = f"{GROUP}/attempt"
LABEL_ROLE_ATTEMPT: Final = f"{GROUP}/role-attempt"  # a pod's generation within its role (restarts of the role alone)
LABEL_REPLICA: Final = f"{GROUP}/replica"  # an engine pod's replica index
LABEL_ENGINE_REPLICA: Final = f"{GROUP}/engine-replica"  # an engine pod's replica index (contract)
LABEL_ENGINE_NODE: Final = f"{GROUP}/engine-node"  # an engine pod's node within its replica, 0 = leader (contract)

ROLE_ROLLOUT: Final = "rollout"
ROLE_TRAINER: Final = "trainer"
ROLE_STORE: Final = "store"
ROLE_CONFIG: Final = "config"
ROLE_ENGINE: Final = "engine"  # the run's own vLLM server (rollout.engine.type vllm without url); outlives attempts
GROUP_ROLES: Final = (ROLE_ROLLOUT, ROLE_TRAINER)  # the pods of one attempt (the store outlives attempts)

ANNOTATION_SPEC: Final = f"{GROUP}/spec"
ANNOTATION_CONFIG_HASH: Final = f"{GROUP}/spec-hash"  # on the run's ConfigMap: a hash of the manifest it holds
ANNOTATION_PREFIX: Final = GROUP  # kopf's progress and diff-base annotations
FINALIZER: Final = f"{GROUP}/operator"
MANAGED_BY_OPERATOR: Final = f"{GROUP}/operator"  # spec.managedBy of runs this operator runs (unset means the same)
EVENT_SOURCE: Final = "trainingrun-operator"
