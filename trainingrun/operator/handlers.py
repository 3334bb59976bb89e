"""Kopf handlers. Importing this module registers them in kopf's default registry (`trainingrun operator` does).

  - `login`: credentials through the official `kubernetes` client (`trainingrun.operator.kube`): $KUBECONFIG, else
    the in-cluster service account, else the default kubeconfig; the same identity for kopf and our own calls.
  - `trpods`, `trconfigmaps`, `trservices` (indexes): the run's pods (summarised, `observe.PodObs`), ConfigMap and
    Services, keyed by (namespace, run). Every watch asks the API server for the runs' objects only (a server-side
    label selector), so the operator never lists every pod of the cluster. Their events wake the run's daemon; a
    pod's DELETED event leaves its last state (`OperatorState.gone`), so a pod evicted and removed is still known as
    evicted.
  - `run_daemon` (daemon per TrainingRun): reconcile at once (children within milliseconds of creation), then on
    every change of the run's pods or children, on spec changes, at deadlines, and at least every `--interval`
    seconds (progress refresh, hang detection). One reconcile: observe (indexes, the store's progress, the API
    server's last refusal) → `status.decide` → write the status with the observed resourceVersion as
    precondition → post events → act (delete, update, create children; pods only after what they need exists).
  - `spec_changed` (on.update of spec): mutable fields take effect; other changes are ignored with a Warning event.
    spec.rollout.engine.replicas resizes the engine pool of a running run (`status._engine_pool`), except while Kueue
    manages the run (spec.queueName): then the change is ignored with a ResizeRefused Warning (the CRD's transition
    rule engine-replicas-fixed-under-kueue refuses it on a real API server), and in a run without engine servers
    of its own. Changes are classified leaf by leaf (`_changed_paths`).

A run whose `spec.managedBy` names another controller (e.g. MultiKueue's `kueue.x-k8s.io/multikueue`) matches no
handler (`managed_here`): the operator starts no daemon for it, adds no finalizer or annotation, creates nothing and
writes no status; that controller runs it.

With gang provider kubernetes the operator finds the scheduling.k8s.io version the cluster serves by discovery
(`OperatorState.scheduling_version`, cached a minute, "none" for 5 s; forgotten when a create of its objects gets
404), renders the Workload and PodGroup in it, and refuses their creation with a clear message (FailedCreate,
retried) when none is served.

The run's spec is frozen at its first reconcile (annotation `trainingrun.dev/spec`), except MUTABLE_FIELDS.

State lives in kopf's memos, never in a module global: the operator's memo (`operator_memo`, passed to
`kopf.operator(memo=...)`) holds the process's `OperatorState` (settings, the API client, the progress reader, the
live runs by key, the last state of deleted pods); every resource's memo is a shallow copy of it, and a TrainingRun's
memo also holds its `RunState` (the daemon's wake-up and lock, the API server's last refusal, children created but not
yet seen, its PodGroups), which kopf forgets with the object. A new `kopf.operator()` starts with nothing, as a new
process would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_PREFIX,
    ANNOTATION_SPEC,
    API_VERSION,
    APP,
    EVENT_SOURCE,
    FINALIZER,
    GROUP,
    KIND,
    LABEL_NAME,
    LABEL_RUN,
    MANAGED_BY_OPERATOR,
    PLURAL,
    VERSION,
)
from trainingrun.api.models import TrainingRun
from trainingrun.operator import gang, kube, metrics, status
from trainingrun.operator.checks import cluster_errors, memory_errors
from trainingrun.operator.kube import ApiError, Conflict, KubeApi
from trainingrun.operator.observe import Observed, PodObs, Refusal, is_permanent, observe_pod
from trainingrun.operator.progress import ProgressReader
from trainingrun.operator.reconcile import EVENT_MESSAGE_MAX, Decision, bounded, now_utc
from trainingrun.operator.render import DEFAULT_REDIS_IMAGE, render_child
from trainingrun.operator.vocabulary import Child, Names, Owner, engine_replicas, store_url

log = logging.getLogger("trainingrun.operator")

ENGINE_REPLICAS = ("rollout", "engine", "replicas")
# Spec fields that take effect while a run exists (paths under spec); everything else is frozen at the first reconcile.
MUTABLE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("suspend",), ("activeDeadlineSeconds",), ("ttlSecondsAfterFinished",), ("failurePolicy",),
    ("trainer", "replicas"),  # elastic data parallelism: the group restarts at the new size
    ENGINE_REPLICAS,  # the engine pool resized on a running run (the scale subresource); not under Kueue
)
RUN_SELECTOR = f"{LABEL_NAME}={APP},{LABEL_RUN}"  # server-side: the runs' children only
CHILD_FILTER = {LABEL_NAME: APP, LABEL_RUN: kopf.PRESENT}
CREATE_RETRY_MAX = 60.0  # seconds between retries of a refused create, at most
EXPECT_SECONDS = 30.0  # how long a created child counts as existing before a watch shows it
DISCOVERY_SECONDS = 60.0  # how long a discovered scheduling.k8s.io version is trusted
DISCOVERY_SECONDS_NONE = 5.0  # ... and that none is served (an API enabled meanwhile is found within seconds)


def _changed_paths(diff: kopf.Diff) -> list[tuple[str, ...]]:
    """The spec paths a diff changes, down to the leaves where a whole object was added or removed (adding
    `rollout.engine: {replicas: 2}` changes rollout.engine.replicas, a mutable field)."""
    out: list[tuple[str, ...]] = []

    def walk(parts: tuple[str, ...], old: Any, new: Any) -> None:
        if isinstance(old, dict) or isinstance(new, dict):
            old, new = old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    walk((*parts, str(key)), old.get(key), new.get(key))
            return
        out.append(parts)

    for _op, path, old, new in diff:
        parts = tuple(str(p) for p in path)
        walk(parts[1:] if parts and parts[0] == "spec" else parts, old, new)
    return out


def _runs_engine_servers(body: kopf.Body) -> bool:
    """Whether the run's (effective) spec has engine servers of its own (`vocabulary.engine_replicas`); an unparsable
    spec counts as having them (its own failure says why)."""
    try:
        return engine_replicas(parse_run(body)) > 0
    except ValidationError:
        return True


def managed_here(spec: Any, **_: Any) -> bool:
    """Whether this operator runs the TrainingRun: spec.managedBy unset or naming it (kopf's `when` filter)."""
    managed_by = (spec or {}).get("managedBy")
    return managed_by in (None, MANAGED_BY_OPERATOR)


@dataclass
class RefusalRecord:
    """The API server's last refusal to create a child of one run, and when to try again."""

    refusal: Refusal
    tries: int
    retry_at: float  # monotonic
    event_at: float  # monotonic time of the last FailedCreate event for this refusal


@dataclass
class RunState:
    """What the operator keeps about one TrainingRun between its reconciles, in the run's kopf memo (`memo.run`;
    kopf drops it with the object). No run state: every decision is made from observations; these are observations
    and plumbing that no watch shows."""

    wakeup: asyncio.Event = field(default_factory=asyncio.Event)  # set: reconcile now
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    refusal: RefusalRecord | None = None  # the API server's last refusal to create a child
    # {"Kind/name": monotonic time} of children created but not yet seen in a watch: counted as existing for
    # EXPECT_SECONDS, so a reconcile woken before the watch caught up does not create them again
    expected: dict[str, float] = field(default_factory=dict)
    gang: set[str] = field(default_factory=set)  # "Kind/name" of gang objects created or found (no watch on them)


@dataclass
class OperatorState:
    """The operator process's plumbing (settings, the API client, the progress reader, the phase gauge) and what one
    object's handlers leave for another's, in the operator's memo (`memo.state`, also reached from every resource's
    memo): the live runs by (namespace, name), so a pod's event wakes its run's daemon, and the last state of a run's
    deleted pods (a pod's DELETED event may come before the run's daemon looks)."""

    interval: float = 10.0
    redis_image: str = DEFAULT_REDIS_IMAGE
    api_workers: int = 8
    api: KubeApi | None = None
    progress: ProgressReader = field(default_factory=ProgressReader)
    phases: metrics.PhaseTracker = field(default_factory=metrics.PhaseTracker)
    runs: dict[tuple[str, str], RunState] = field(default_factory=dict)  # (namespace, name) -> a live daemon's state
    gone: dict[tuple[str, str], dict[str, PodObs]] = field(default_factory=lambda: defaultdict(dict))
    reconciles: Counter = field(default_factory=Counter)  # (namespace, run) -> reconciles done (tests, debugging)
    # (monotonic time, the scheduling.k8s.io version served: gang.served_version) of the last discovery
    scheduling: tuple[float, str | None] | None = None

    def wake(self, key: tuple[str, str]) -> None:
        run = self.runs.get(key)
        if run is not None:
            run.wakeup.set()

    async def scheduling_version(self) -> str | None:
        """The scheduling.k8s.io version whose Workload and PodGroup this cluster serves (discovery, cached)."""
        if self.scheduling is not None and time.monotonic() - self.scheduling[0] < (
                DISCOVERY_SECONDS if self.scheduling[1] else DISCOVERY_SECONDS_NONE):
            return self.scheduling[1]
        assert self.api is not None
        served: dict[str, list[str]] = {}
        for version in gang.SCHEDULING_VERSIONS:
            try:
                doc = await self.api.get(f"/apis/{gang.SCHEDULING_GROUP}/{version}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                continue
            served[version] = [r.get("name", "") for r in (doc or {}).get("resources") or []]
        self.scheduling = (time.monotonic(), gang.served_version(served))
        return self.scheduling[1]


def operator_memo(**settings: Any) -> kopf.Memo:
    """The memo to run the operator with (`kopf.operator(memo=...)`): a fresh `OperatorState(**settings)`."""
    return kopf.Memo(state=OperatorState(**settings))


# ------------------------------------------------------------------------------------------------------ plumbing
@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if not isinstance(memo.get("state"), OperatorState):
        memo["state"] = OperatorState()  # run without `operator_memo` (e.g. `kopf run`): the default settings
    # Only warnings of kopf's own logs become Kubernetes Events; lifecycle events are posted explicitly.
    settings.posting.level = logging.WARNING
    # `kubectl describe tr` shows this in the Events' "From" column (kopf's default is "kopf").
    settings.posting.reporting_component = EVENT_SOURCE
    settings.posting.reporting_instance = os.environ.get("HOSTNAME") or socket.gethostname()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.networking.request_timeout = 60
    settings.queueing.error_delays = (1, 2, 5, 10, 30)
    # kopf's `labels=` filters are client-side: without these, every pod, ConfigMap and Service of the cluster would
    # be listed and watched.
    for plural in ("pods", "configmaps", "services"):
        settings.watching.label_selectors["v1", plural] = RUN_SELECTOR


@kopf.on.login()
def login(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """The official client's configuration ($KUBECONFIG, in-cluster, default kubeconfig) for kopf and our calls."""
    import kubernetes.config  # deferred: kubernetes

    state: OperatorState = memo.state
    try:
        cfg = kube.load_configuration()
    except kubernetes.config.ConfigException as exc:
        raise kopf.LoginError(f"no credentials: {exc} (set KUBECONFIG, or run in a pod with a service account)")
    old, state.api = state.api, KubeApi(cfg, workers=state.api_workers)
    if old is not None:
        old.close()
    return kube.connection_info(cfg, trust_env=settings.networking.trust_env)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    state: OperatorState = memo.state
    if state.api is not None:
        state.api.close()
        state.api = None


@kopf.index("v1", "pods", labels=CHILD_FILTER)
def trpods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[LABEL_RUN]): observe_pod(body)}


@kopf.index("v1", "configmaps", labels=CHILD_FILTER)
def trconfigmaps(namespace: str, name: str, labels: dict[str, str], annotations: dict[str, str], **_: Any) -> dict:
    return {(namespace, labels[LABEL_RUN]): (name, annotations.get(ANNOTATION_CONFIG_HASH))}


@kopf.index("v1", "services", labels=CHILD_FILTER)
def trservices(namespace: str, name: str, labels: dict[str, str], **_: Any) -> dict:
    return {(namespace, labels[LABEL_RUN]): name}


@kopf.on.event("v1", "pods", labels=CHILD_FILTER)
def pod_event(event: dict, namespace: str, labels: dict[str, str], body: kopf.Body, memo: kopf.Memo,
              **_: Any) -> None:
    """Any change of a run's pod wakes that run's daemon; a deleted pod's last state is kept (was it evicted?)."""
    state: OperatorState = memo.state
    key = (namespace, labels[LABEL_RUN])
    if event.get("type") == "DELETED":
        pod = observe_pod(body)
        state.gone[key][pod.name] = pod
    state.wake(key)


@kopf.on.event("v1", "configmaps", labels=CHILD_FILTER)
@kopf.on.event("v1", "services", labels=CHILD_FILTER)
def child_event(namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any) -> None:
    """A run's ConfigMap or Service appeared, changed or went away: look at the run again."""
    memo.state.wake((namespace, labels[LABEL_RUN]))


# ------------------------------------------------------------------------------------------------------ the spec
def effective_spec(body: kopf.Body) -> dict[str, Any]:
    """The spec frozen at the first reconcile, with MUTABLE_FIELDS taken from the live spec."""
    live = dict(body.get("spec") or {})
    raw = (body.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SPEC)
    if not raw:
        return live
    try:
        frozen = json.loads(raw)
    except ValueError:
        return live
    for path in MUTABLE_FIELDS:
        if path == ENGINE_REPLICAS and frozen.get("queueName"):
            continue  # Kueue admitted the engines as one pod group of a fixed size (the CRD refuses it too)
        source: Any = live
        for part in path[:-1]:
            source = source.get(part) if isinstance(source, dict) else None
        if isinstance(source, dict) and path[-1] in source:
            target = frozen
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = source[path[-1]]
            continue
        target = frozen
        for part in path[:-1]:
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target.pop(path[-1], None)
    return frozen


def parse_run(body: kopf.Body) -> TrainingRun:
    meta = body.get("metadata", {})
    return parse_trainingrun({
        "apiVersion": API_VERSION,
        "kind": KIND,
        # uid and creationTimestamp: the store prefix and TRAININGRUN_RUN_EPOCH of a re-created run (vocabulary.py)
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                     **{k: meta[k] for k in ("uid", "creationTimestamp") if meta.get(k)}},
        "spec": effective_spec(body),
    })


def describe_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']}")
    return "invalid spec: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------------ reconcile
def observe(state: OperatorState, run_state: RunState, run: TrainingRun, body: kopf.Body, current: dict[str, Any],
            indexes: dict[str, kopf.Index]) -> Observed:
    meta = body.get("metadata", {})
    ns, name = meta.get("namespace"), meta.get("name")
    key = (ns, name)
    names = Names(name)
    children = {f"Service/{svc}" for svc in indexes["trservices"].get(key, [])}
    config_hash = None
    for cm, digest in indexes["trconfigmaps"].get(key, []):
        children.add(f"ConfigMap/{cm}")
        if cm == names.config:
            config_hash = digest
    children |= {key for key in run_state.gang if names.is_podgroup(key.partition("/")[2])}
    pods = tuple(indexes["trpods"].get(key, []))
    seen = children | {f"Pod/{p.name}" for p in pods}
    if run_state.expected:
        now = time.monotonic()
        run_state.expected = {k: t for k, t in run_state.expected.items() if k not in seen and now - t < EXPECT_SECONDS}
        children |= set(run_state.expected)
    progress = None
    if current.get("phase") in ("Running", "Restarting"):
        progress = state.progress.peek(store_url(run, ns), run_state.wakeup.set)
    record = run_state.refusal
    return Observed(
        pods=pods,
        gone=tuple(state.gone.get(key, {}).values()),
        children=frozenset(children),
        config_hash=config_hash,
        progress=progress,
        refusal=record.refusal if record is not None else None,
        spec_errors=tuple(cluster_errors(run)),
        memory_errors=tuple(memory_errors(run)) if current.get("phase") is None else (),
        generation=meta.get("generation"),
    )


async def reconcile(state: OperatorState, run_state: RunState, body: kopf.Body,
                    indexes: dict[str, kopf.Index]) -> float | None:
    """One observe → decide → write → act step. Returns a wake-up hint (seconds) or None."""
    api = state.api
    assert api is not None, "login handler has not run"
    meta = body.get("metadata", {})
    ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if meta.get("deletionTimestamp"):
        return None
    current = dict(body.get("status") or {})
    now = now_utc()
    run: TrainingRun | None = None
    try:
        run = parse_run(body)
    except ValidationError as exc:
        decision = status.invalid_spec(current, describe_validation(exc), now=now, generation=meta.get("generation"))
    else:
        decision = status.decide(run, current, observe(state, run_state, run, body, current, indexes), now=now)
    changes = status.status_changes(current, decision.status)
    if changes:
        try:
            await api.patch(API_VERSION, KIND, ns, name,
                            {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": changes},
                            subresource="status")
        except Conflict:
            log.debug("%s/%s: stale observation (resourceVersion %s); deciding again", ns, name,
                      meta.get("resourceVersion"))
            return 0.2  # observed a stale object; decide again on the fresh one
        log.debug("%s/%s: status %s", ns, name, changes)
    if run is not None and ANNOTATION_SPEC not in (meta.get("annotations") or {}):
        frozen = json.dumps(run.spec.to_dict(), sort_keys=True, separators=(",", ":"))
        await api.patch(API_VERSION, KIND, ns, name, {"metadata": {"annotations": {ANNOTATION_SPEC: frozen}}})
    for type_, reason, message in decision.events:
        kopf.event(body, type=type_, reason=reason, message=message)
    if decision.restarted:
        metrics.RESTARTS.inc()
    attempt = int(decision.status.get("attempt") or 0)
    gone = state.gone.get((ns, name))
    if gone:
        state.gone[(ns, name)] = {n: p for n, p in gone.items() if p.attempt is not None and p.attempt >= attempt}
    state.phases.set(uid, decision.status.get("phase"), namespace=ns, name=name,
                     restarts=decision.status.get("restarts"), step=decision.status.get("step"),
                     progress=decision.status.get("progress"), engines=decision.status.get("engineReplicas"))
    hint = await act(state, run_state, decision, run, body)
    if hint is not None:
        decision.wake_in(hint)
    return decision.requeue_after


async def act(state: OperatorState, run_state: RunState, decision: Decision, run: TrainingRun | None,
              body: kopf.Body) -> float | None:
    """Delete, update and create what the decision says; returns a retry hint after a refused create."""
    api = state.api
    assert api is not None
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    if run is not None and run.spec.queue_name and decision.delete_pods:
        # Kueue keeps a pod group's quota while it waits for replacement pods; this annotation says there will be
        # none (the next attempt is a new group), so Kueue finishes the workload once the pods are gone.
        await asyncio.gather(*(_annotate(api, ns, pod, {gang.KUEUE_RETRIABLE_ANNOTATION: "false"})
                               for pod in decision.delete_pods))
    await asyncio.gather(*(api.delete("v1", "Pod", ns, pod) for pod in decision.delete_pods + decision.replace_pods))
    if decision.delete_run:
        state.phases.set(uid, None)
        await api.delete(API_VERSION, KIND, ns, name)
        return None
    if run is None:
        return None
    provider = gang.provider(run, await state.scheduling_version() if _kubernetes_gang(run) else None)
    for child in decision.delete:  # gang objects of earlier attempts
        if provider is not None:
            await api.delete(provider.api_version, child.kind, ns, child.name)
        run_state.gang.discard(child.key)
    if decision.resize_engine_gang and provider is not None:
        await _resize_engine_gang(api, provider, run, body)
    if not decision.create and not decision.update:
        return None
    record = run_state.refusal
    if record is not None and time.monotonic() < record.retry_at:
        return record.retry_at - time.monotonic()  # backing off after a refusal
    owner = Owner(name=name, namespace=ns, uid=uid)
    attempt = int(decision.status.get("attempt") or 0)
    try:
        for child in decision.update:
            obj = render_child(run, owner, child, attempt, redis_image=state.redis_image)
            await api.patch("v1", child.kind, ns, child.name,
                            {"metadata": {"annotations": obj["metadata"].get("annotations")}, "data": obj["data"]})
        base = [c for c in decision.create if not c.group_pod]
        group = [c for c in decision.create if c.group_pod]
        for child in base:  # in order: what the pods mount and resolve first
            await create(state, run_state, run, owner, child, attempt)
        results = await asyncio.gather(*(create(state, run_state, run, owner, c, attempt) for c in group),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    except _Refused as refused:
        return refused_create(state, run_state, body, refused)
    if record is not None:
        run_state.refusal = None  # the creates went through
        run_state.wakeup.set()
    return None


async def _resize_engine_gang(api: KubeApi, provider: gang.GangProvider, run: TrainingRun, body: kopf.Body) -> None:
    """The engines' serving gang object (R-engine: PodGroup minMember, Workload minCount) brought to the pool's new
    size by a merge patch of its spec; a refusal (an immutable field, an object gone) is a Warning, not a failure:
    the pool runs on. Multi-node replicas have a gang each (R-engine-<i>, of a fixed size): nothing to resize (an
    added replica's is created with the base children; a removed one's stays until the run ends, reused if the pool
    grows again)."""
    meta = body["metadata"]
    group = Names(meta["name"]).engine
    if gang.engine_groups(run, group, 1) != [(None, group)]:
        return
    for kind in provider.kinds:
        try:
            await api.patch(provider.api_version, kind, meta["namespace"], group,
                            {"spec": provider.spec(kind, run, group, engines=True)})
        except ApiError as exc:
            kopf.event(body, type="Warning", reason="EngineGangNotResized", message=bounded(
                f"{kind} {group} keeps its size: {exc.detail}", EVENT_MESSAGE_MAX))


async def _annotate(api: KubeApi, ns: str, pod: str, annotations: dict[str, str]) -> None:
    try:
        await api.patch("v1", "Pod", ns, pod, {"metadata": {"annotations": annotations}})
    except ApiError as exc:
        if exc.status != 404:
            raise


class _Refused(Exception):
    def __init__(self, refusal: Refusal):
        super().__init__(refusal.describe())
        self.refusal = refusal


def _kubernetes_gang(run: TrainingRun) -> bool:
    return run.spec.gang_scheduling.enabled and run.spec.gang_scheduling.provider == "kubernetes"


async def create(state: OperatorState, run_state: RunState, run: TrainingRun, owner: Owner, child: Child,
                 attempt: int) -> None:
    api = state.api
    assert api is not None
    gang_object = child.kind in ("PodGroup", "Workload")
    version = await state.scheduling_version() if _kubernetes_gang(run) else None
    if gang_object and _kubernetes_gang(run) and version is None:
        raise _Refused(Refusal(kind=child.kind, name=child.name, code=404, message=gang.not_served_message(run),
                               permanent=False))
    obj = render_child(run, owner, child, attempt, redis_image=state.redis_image, gang_version=version)
    try:
        await api.create(obj)
    except ApiError as exc:
        message = exc.detail
        if gang_object and exc.status == 404:
            state.scheduling = None  # discover again: the API may have gone (or come)
            message = gang.not_served_message(run)
        raise _Refused(Refusal(kind=child.kind, name=child.name, code=exc.status, message=message,
                               permanent=is_permanent(exc.status))) from exc
    if gang_object:
        run_state.gang.add(child.key)
    else:
        run_state.expected[child.key] = time.monotonic()


def refused_create(state: OperatorState, run_state: RunState, body: kopf.Body, refused: _Refused) -> float:
    """Remember the refusal (an observation for the next decision), post a FailedCreate Warning (once per distinct
    refusal per minute) and back off exponentially (1 s, 2 s, ... 60 s) before the next try."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    now = time.monotonic()
    old = run_state.refusal
    same = old is not None and old.refusal == refused.refusal
    tries = old.tries + 1 if old is not None else 1
    delay = min(2.0 ** (tries - 1), CREATE_RETRY_MAX)
    event_at = old.event_at if same and old is not None else -1e9
    if now - event_at > 60:
        kopf.event(body, type="Warning", reason="FailedCreate",
                   message=bounded(refused.refusal.describe(), EVENT_MESSAGE_MAX))
        event_at = now
    run_state.refusal = RefusalRecord(refused.refusal, tries=tries, retry_at=now + delay, event_at=event_at)
    log.info("%s/%s: %s (retrying in %.0fs)", *key, refused.refusal.describe(), delay)
    if refused.refusal.permanent:
        run_state.wakeup.set()  # decide at once: the run fails with the server's message
        return 0.05
    return delay


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=2.0, when=managed_here)
async def run_daemon(body: kopf.Body, namespace: str, name: str, uid: str, stopped: kopf.DaemonStopped,
                     memo: kopf.Memo, trpods: kopf.Index, trconfigmaps: kopf.Index, trservices: kopf.Index,
                     **_: Any) -> None:
    """Reconciles one TrainingRun for as long as it exists; its `RunState` lives in the run's memo."""
    state: OperatorState = memo.state
    key = (namespace, name)
    run_state = memo["run"] = RunState()
    state.runs[key] = run_state
    indexes = {"trpods": trpods, "trconfigmaps": trconfigmaps, "trservices": trservices}
    state.progress.max_age = min(max(state.interval / 2, 0.5), 5.0)
    try:
        while not stopped:
            run_state.wakeup.clear()
            started = time.perf_counter()
            hint: float | None = None
            try:
                async with run_state.lock:
                    hint = await asyncio.wait_for(reconcile(state, run_state, body, indexes), timeout=120)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged, counted, retried after a pause
                metrics.ERRORS.labels(handler="reconcile").inc()
                log.warning("reconcile of %s/%s failed (retrying): %s", namespace, name, exc)
                hint = 5.0
            finally:
                metrics.RECONCILE_SECONDS.labels(handler="reconcile").observe(time.perf_counter() - started)
                state.reconciles[key] += 1
            wait = state.interval if hint is None else max(0.05, min(hint, state.interval))
            try:
                await asyncio.wait_for(run_state.wakeup.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass
    finally:
        try:
            state.progress.forget(store_url(parse_run(body), namespace))
        except Exception:  # noqa: BLE001 - an unparsable spec never opened a store
            pass
        if state.runs.get(key) is run_state:
            del state.runs[key]
        memo.pop("run", None)
        state.gone.pop(key, None)
        state.phases.set(uid, None)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", retries=5, backoff=2, timeout=60, when=managed_here)
def spec_changed(diff: kopf.Diff, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Mutable fields take effect; other changes are ignored (the run keeps its frozen spec) with a Warning."""
    applied, ignored, kueue, serverless = [], [], [], []
    queued = bool(effective_spec(body).get("queueName"))
    for parts in _changed_paths(diff):
        dotted = "spec." + ".".join(parts) if parts else "spec"
        if parts[:len(ENGINE_REPLICAS)] == ENGINE_REPLICAS and (queued or not _runs_engine_servers(body)):
            (kueue if queued else serverless).append(dotted)
            continue
        mutable = any(parts[:len(m)] == m for m in MUTABLE_FIELDS)
        (applied if mutable else ignored).append(dotted)
    if serverless:
        kopf.event(body, type="Warning", reason="ResizeRefused", message=(
            "spec.rollout.engine.replicas counts the run's own engine servers, and this run has none (an engine in "
            "the rollout process, replayed rollouts, or servers of its own at rollout.engine.url): nothing to resize"))
    if kueue:
        kopf.event(body, type="Warning", reason="ResizeRefused", message=(
            "spec.rollout.engine.replicas cannot change while Kueue manages the run (spec.queueName): Kueue admitted "
            "its engines as one pod group of that size; the pool keeps its size (create a new TrainingRun to change "
            "it)"))
    if applied:
        kopf.event(body, type="Normal", reason="SpecUpdated", message=f"applied: {', '.join(sorted(set(applied)))}")
    if ignored:
        allowed = ", ".join("spec." + ".".join(m) for m in MUTABLE_FIELDS)
        kopf.event(body, type="Warning", reason="SpecChangeIgnored", message=(
            f"ignored during the run: {', '.join(sorted(set(ignored)))}; only {allowed} can change (create a new "
            "TrainingRun for other changes)"))
    run_state = memo.get("run")  # the run's daemon, through the run's own memo
    if isinstance(run_state, RunState):
        run_state.wakeup.set()
