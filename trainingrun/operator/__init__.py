"""trainingrun.operator: the Kopf operator (`trainingrun operator`): a TrainingRun → its children in the cluster and
its status (docs/operator.md). The same RunPlan as the local launcher (`trainingrun.plan`), the same failure policy
(`trainingrun.failure_policy`). The renderers, the rules and the decisions are pure; the handlers act on them.

Module map:
  main.py        the command line: run the operator (kopf), its liveness and metrics servers
  handlers.py    the kopf wiring: indexes, timers and events gather the observations, `status.decide` decides, the
                 actions are performed (state in kopf's memos)
  kube.py        credentials and the operator's own API calls, through the official `kubernetes` client
  vocabulary.py  who owns a run's children, their names, which children an attempt needs, store URL, epoch,
                 ConfigMap hash
  render.py      one pure function per child object, dispatched by (kind, role): ConfigMap, Services, Pods, the
                 managed Redis, the engine servers (the engine table's `ServerPods`)
  gang.py        gang scheduling and placement as pluggable renderers: PodGroup / scheduling.k8s.io Workload, Kueue
                 labels, topology
  checks.py      what a schema-valid run needs in a cluster beyond the CRD's rules
  observe.py     what the operator observes about a run, as plain values (`PodObs`, the children, the progress)
  status.py      the lifecycle: observations → the next status and the actions (`decide`, a dispatch on the phase)
  reconcile.py   one reconcile's context (`Reconcile`, `Decision`): conditions, the phase, the current pods
  roles.py       the ledger of roles restarted alone (status.roleRestarts) and the rules of a replacement
  pool.py        the engine pool's rules: each replica's failure, leaving the pool, readiness, its pod
  pace.py        status.progress and its ETA from the trainers' progress record
  progress.py    the trainers' progress record read from the run's store
  metrics.py     the operator's own metrics (operator-wide and per run)
  rbac.py        the exact RBAC rules, rendered by the Helm chart
"""
