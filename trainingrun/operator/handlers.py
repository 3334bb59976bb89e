"""Kopf handlers. Importing this module registers them in kopf's default registry (`trainingrun operator` does).

  - `trpods` (index): every pod labelled app.kubernetes.io/name=trainingrun, summarised (`status.PodObs`) and keyed
    by (namespace, run); pod events wake the run's daemon.
  - `run_daemon` (daemon per TrainingRun): reconcile at once (children within milliseconds of creation), then on
    every pod change of the run, on spec changes, at deadlines, and at least every `--interval` seconds (progress
    refresh, hang detection). One reconcile: observe (index + store progress) → `status.decide` → write the status
    with the observed resourceVersion as precondition → post events → act (create/delete children).
  - `spec_changed` (on.update of spec): mutable fields take effect; other changes are ignored with a Warning event.

The run's spec is frozen at its first reconcile (annotation `trainingrun.dev/spec`), except MUTABLE_FIELDS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from trainingrun.api import parse_trainingrun
from trainingrun.api.constants import (
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
    PLURAL,
    VERSION,
)
from trainingrun.api.models import TrainingRun
from trainingrun.operator import metrics, render, status
from trainingrun.operator.client import ApiError, Conflict, KubeClient
from trainingrun.operator.progress import ProgressReader

log = logging.getLogger("trainingrun.operator")

MUTABLE_FIELDS = ("suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "failurePolicy")


@dataclass
class OperatorState:
    """Process-wide plumbing (no run state: every decision is made from observations)."""

    interval: float = 10.0
    redis_image: str = render.DEFAULT_REDIS_IMAGE
    client: KubeClient | None = None
    progress: ProgressReader = field(default_factory=ProgressReader)
    phases: metrics.PhaseTracker = field(default_factory=metrics.PhaseTracker)
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))
    locks: dict[str, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    # run uid -> (the API server's last refusal to create a child, when its Warning was posted): an observation
    # shown in the status message of a Pending run until a create succeeds
    create_errors: dict[str, tuple[str, float]] = field(default_factory=dict)

    def wake(self, key: tuple[str, str]) -> None:
        event = self.wakeups.get(key)
        if event is not None:
            event.set()


STATE = OperatorState()


# ------------------------------------------------------------------------------------------------------ plumbing
@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
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
    settings.batching.error_delays = (1, 2, 5, 10, 30)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo:
    """In-cluster service account first, then the kubeconfig ($KUBECONFIG); our own client shares the credentials."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig ($KUBECONFIG) found")
    STATE.client = KubeClient.from_connection_info(info)
    return info


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if STATE.client is not None:
        await STATE.client.close()


@kopf.index("v1", "pods", labels={LABEL_NAME: APP, LABEL_RUN: kopf.PRESENT})
def trpods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[LABEL_RUN]): status.observe_pod(body)}


@kopf.on.event("v1", "pods", labels={LABEL_NAME: APP, LABEL_RUN: kopf.PRESENT})
def pod_event(namespace: str, labels: dict[str, str], **_: Any) -> None:
    """Any change of a run's pod (including deletion) wakes that run's daemon."""
    STATE.wake((namespace, labels[LABEL_RUN]))


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
    for key in MUTABLE_FIELDS:
        if key in live:
            frozen[key] = live[key]
        else:
            frozen.pop(key, None)
    return frozen


def parse_run(body: kopf.Body) -> TrainingRun:
    meta = body.get("metadata", {})
    return parse_trainingrun({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": effective_spec(body),
    })


def describe_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']}")
    return "invalid spec: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------------ reconcile
async def reconcile(body: kopf.Body, index: kopf.Index) -> float | None:
    """One observe → decide → write → act step. Returns a wake-up hint (seconds) or None."""
    client = STATE.client
    assert client is not None, "login handler has not run"
    meta = body.get("metadata", {})
    ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if meta.get("deletionTimestamp"):
        return None
    current = dict(body.get("status") or {})
    now = status.now_utc()
    run: TrainingRun | None = None
    try:
        run = parse_run(body)
    except ValidationError as exc:
        decision = status.invalid_spec(current, describe_validation(exc), now=now, generation=meta.get("generation"))
    else:
        pods = list(index.get((ns, name), []))
        progress = None
        if current.get("phase") in ("Running", "Restarting"):
            progress = STATE.progress.peek(render.store_url(run, ns), lambda: STATE.wake((ns, name)))
        decision = status.decide(
            run, current, pods, now=now, generation=meta.get("generation"), progress=progress,
            spec_errors=render.cluster_errors(run),
        )
    refusal = STATE.create_errors.get(uid)
    if refusal is not None and decision.status.get("phase") == "Pending" and decision.create_pods:
        decision.status["message"] = refusal[0]
    changes = status.status_changes(current, decision.status)
    if changes:
        try:
            await client.patch(API_VERSION, KIND, ns, name,
                               {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": changes},
                               plural=PLURAL, subresource="status")
        except Conflict:
            log.debug("%s/%s: stale observation (resourceVersion %s); deciding again", ns, name,
                      meta.get("resourceVersion"))
            return 0.2  # observed a stale object; decide again on the fresh one
        log.debug("%s/%s: status %s", ns, name, changes)
    if run is not None and ANNOTATION_SPEC not in (meta.get("annotations") or {}):
        frozen = json.dumps(run.spec.to_dict(), sort_keys=True, separators=(",", ":"))
        await client.patch(API_VERSION, KIND, ns, name,
                           {"metadata": {"annotations": {ANNOTATION_SPEC: frozen}}}, plural=PLURAL)
    for type_, reason, message in decision.events:
        kopf.event(body, type=type_, reason=reason, message=message[:1000])
    if decision.restarted:
        metrics.RESTARTS.inc()
    STATE.phases.set(uid, decision.status.get("phase"), namespace=ns, name=name,
                     restarts=decision.status.get("restarts"), step=decision.status.get("step"))
    await act(decision, run, body)
    return decision.requeue_after


async def act(decision: status.Decision, run: TrainingRun | None, body: kopf.Body) -> None:
    client = STATE.client
    assert client is not None
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    for pod in decision.delete_pods:
        await client.delete("v1", "Pod", ns, pod)
    if decision.delete_run:
        STATE.phases.set(meta["uid"], None)
        await client.delete(API_VERSION, KIND, ns, name, plural=PLURAL)
        return
    if run is None:
        return
    owner = render.Owner(name=name, namespace=ns, uid=meta["uid"])
    attempt = int(decision.status.get("attempt") or 0)
    objs: list[dict[str, Any]] = []
    if decision.create_base:
        objs += [render.render_config_map(run, owner), render.render_service(run, owner)]
        objs += [o for o in render.render_store(run, owner, STATE.redis_image) if o["kind"] == "Service"]
        pg = render.render_podgroup(run, owner)
        if pg is not None:
            objs.append(pg)
    if decision.create_store_pod:
        objs += [o for o in render.render_store(run, owner, STATE.redis_image) if o["kind"] == "Pod"]
    if decision.create_pods:
        plan = render.plan_for(run, ns, attempt)
        wanted = set(decision.create_pods)
        objs += [render.render_process_pod(run, owner, p, attempt) for p in plan.processes if (p.role, p.rank) in wanted]
    failed: ApiError | None = None
    for obj in objs:
        try:
            await client.create(obj)
        except ApiError as exc:
            if obj["kind"] == "PodGroup" and exc.status == 404:
                message = (f"spec.gangScheduling: the PodGroup API {obj['apiVersion']} is not served by this cluster "
                           f"(install {run.spec.gang_scheduling.provider} or disable gangScheduling)")
                kopf.event(body, type="Warning", reason="InvalidSpec", message=message)
                raise kopf.TemporaryError(message, delay=30) from exc
            if exc.status >= 500 or failed is not None:
                failed = failed or exc
                continue  # try the other children; report the first refusal
            failed = exc
            refusal = f"cannot create {obj['kind']} {obj['metadata']['name']}: {exc.detail}"
            # e.g. an exceeded ResourceQuota, a missing PriorityClass, a rejected volume: without this the run would
            # only say "waiting for N pod(s) to start". One Warning per distinct refusal per minute (retries are 5 s).
            last = STATE.create_errors.get(meta["uid"])
            if last is None or last[0] != refusal or time.monotonic() - last[1] > 60:
                kopf.event(body, type="Warning", reason="FailedCreate", message=refusal[:1000])
                STATE.create_errors[meta["uid"]] = (refusal, time.monotonic())
    if failed is not None:
        raise failed
    if objs:
        STATE.create_errors.pop(meta["uid"], None)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=2.0)
async def run_daemon(body: kopf.Body, namespace: str, name: str, uid: str, stopped: kopf.DaemonStopped,
                     trpods: kopf.Index, **_: Any) -> None:
    """Reconciles one TrainingRun for as long as it exists."""
    key = (namespace, name)
    wakeup = STATE.wakeups[key]
    STATE.progress.max_age = min(max(STATE.interval / 2, 0.5), 5.0)
    try:
        while not stopped:
            wakeup.clear()
            started = time.perf_counter()
            hint: float | None = None
            try:
                async with STATE.locks[uid]:
                    hint = await asyncio.wait_for(reconcile(body, trpods), timeout=120)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged, counted, retried after a pause
                metrics.ERRORS.labels(handler="reconcile").inc()
                log.warning("reconcile of %s/%s failed (retrying): %s", namespace, name, exc)
                hint = 5.0
            finally:
                metrics.RECONCILE_SECONDS.labels(handler="reconcile").observe(time.perf_counter() - started)
            wait = STATE.interval if hint is None else max(0.05, min(hint, STATE.interval))
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass
    finally:
        try:
            STATE.progress.forget(render.store_url(parse_run(body), namespace))
        except Exception:  # noqa: BLE001 - an unparsable spec never opened a store
            pass
        STATE.wakeups.pop(key, None)
        STATE.locks.pop(uid, None)
        STATE.create_errors.pop(uid, None)
        STATE.phases.set(uid, None)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", retries=5, backoff=2, timeout=60)
def spec_changed(diff: kopf.Diff, body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
    """Mutable fields take effect; other changes are ignored (the run keeps its frozen spec) with a Warning."""
    applied, ignored = [], []
    for op, path, _old, _new in diff:
        parts = [str(p) for p in path]
        if parts and parts[0] == "spec":
            parts = parts[1:]
        dotted = "spec." + ".".join(parts) if parts else "spec"
        (applied if parts and parts[0] in MUTABLE_FIELDS else ignored).append(dotted)
    if applied:
        kopf.event(body, type="Normal", reason="SpecUpdated", message=f"applied: {', '.join(sorted(set(applied)))}")
    if ignored:
        kopf.event(body, type="Warning", reason="SpecChangeIgnored", message=(
            f"ignored during the run: {', '.join(sorted(set(ignored)))}; only spec."
            f"{', spec.'.join(MUTABLE_FIELDS)} can change (create a new TrainingRun for other changes)"))
    STATE.wake((namespace, name))
