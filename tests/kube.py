"""KMock fidelity layer + helpers to run the real operator against it (tests and benchmarks/operator.py).

`FidelityEmulator` subclasses KMock's `KubernetesEmulator` with what the operator (kopf + the kubernetes client) and
kubectl rely on and KMock (the installed version, 0.8) lacks; each piece is asserted in
tests/unit/test_kube_fidelity.py, which also asserts that stock KMock still lacks it (when a KMock upgrade does it
natively, that test fails: delete the piece here instead of keeping two). This layer is kept to that: API-server
behaviour the emulator lacks and the operator needs. Anything else of a real API server belongs in the real-cluster
tests (tests/e2e), not here.
  - uid, resourceVersion (one global counter), generation (bumped on spec changes), creationTimestamp; generateName;
  - patches are applied by KMock's own object model (`kmock.Object.patch`: RFC 7386 merge patch, strategic merge
    treated as merge, and RFC 6902 JSON patch); added here: a failed JSON-patch `test` → 422, a
    `metadata.resourceVersion` precondition → 409 on mismatch, no-op patches change nothing;
  - status subresource: PATCH …/status changes only status, a main-resource PATCH never changes status; a created
    pod starts with status.phase Pending;
  - scale subresource of a CRD (`kubectl scale`): GET/PATCH …/scale read and write the CRD's specReplicasPath as an
    autoscaling/v1 Scale (status replicas and selector from its statusReplicasPath and labelSelectorPath);
  - custom resources validated against their CRD's openAPIV3Schema on every write (status too) → 422 Invalid;
  - deletion: finalizers → deletionTimestamp (a finalizer-held pod stays Terminating, like one on a lost node),
    removal when the last finalizer goes; garbage collection of objects whose ownerReferences point at a deleted uid;
  - 404 for a group/version/resource the server does not serve (a PodGroup without Volcano);
  - `/api/v1/namespaces[/name]` paths; list responses with kind/apiVersion; equality and existence label selectors on
    lists and watches; `/api/v1` discovery reporting groupVersion "v1", subresources listed without short names;
  - admission (`admission` hooks on create): `refuse` (ResourceQuota, a webhook: 403/422/429/5xx, N times or until
    lifted), mutations (Kueue's scheduling gate), `enforce_owner_references` (OwnerReferencesPermissionEnforcement);
    on updates (`update_admission` hooks on PATCH): `refuse_update` (a write lost to a conflict: 409, N times);
  - server-side printing: a GET with `Accept: ...;as=Table` of a CRD resource returns a meta.k8s.io/v1 Table with the
    CRD's additionalPrinterColumns, so the real kubectl prints the columns users see;
  - per client (User-Agent): request counts (the benchmark), Authorization headers, the last watch's query.
Not emulated: watch resourceVersion (kopf sees replays as ADDED: its handlers must be idempotent anyway), field
selectors, PUT, server-side apply. KMock's own finalizer handling lives in the mutation path this layer replaces
(ids, versions and validation must be in the stored object before its watch event goes out), so deletion is here too.

`Cluster` runs the emulator on 127.0.0.1 in a background thread and gives tests a synchronous HTTP API, a kubeconfig,
scenario helpers, the operator in-process (`operator()`, `InProcessOperator`) and as a subprocess (`start_operator`).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime as dt
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import jsonschema
import kmock
import yaml
from kmock import action
from kmock._internal import parsing  # the one internal patched: its path parser (below)

from tests.services import free_port, stop_process, wait_for
from trainingrun.api.constants import API_VERSION, LABEL_ATTEMPT, LABEL_RANK, LABEL_ROLE, LABEL_RUN, PLURAL

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "trainingrun.yaml"
TR = f"{API_VERSION}/{PLURAL}"

# --- KMock's path parser crashes on /api/v1/namespaces[/name[/status|finalize]]: route those to the namespaces
# resource before it sees them (other /api/v1/namespaces/NS/... paths are namespaced resources as before).
_original_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        return parsing.ParsedPath(group="", version="v1", plural="namespaces", namespace=None,
                                  name=parts[3] if len(parts) > 3 else None,
                                  subresource=parts[4] if len(parts) > 4 else None)
    return _original_parse_path(path)


parsing.parse_path = _parse_path


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@attrs.define(kw_only=True)
class FidelityEmulator(kmock.KubernetesEmulator):
    """KMock's emulator with the API semantics listed in the module docstring."""

    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    clients: collections.Counter = attrs.field(factory=collections.Counter, init=False)
    watched: set = attrs.field(factory=set, init=False)
    # "group/version/plural" -> the query parameters of the last watch request (labelSelector, ...)
    watch_params: dict = attrs.field(factory=dict, init=False)
    # client (User-Agent product) -> the Authorization headers it sent
    authorization: dict = attrs.field(factory=lambda: collections.defaultdict(set), init=False)
    printer_columns: dict = attrs.field(factory=dict, init=False)  # (group, version, plural) -> CRD columns
    scales: dict = attrs.field(factory=dict, init=False)  # (group, version, plural) -> the CRD's scale paths
    schemas: dict = attrs.field(factory=dict, init=False)  # (group, version, plural) -> CRD openAPIV3Schema
    # Admission: callables (request, object) run on every create, in order; they may change the object (a mutating
    # webhook) or raise kmock.KubernetesError (a refusal: ResourceQuota, a validating webhook, ...). `refuse` adds one.
    admission: list = attrs.field(factory=list, init=False)
    # Admission of updates: callables (request, patch) run on every PATCH before it applies (`refuse_update`).
    update_admission: list = attrs.field(factory=list, init=False)

    async def _render_error(self, exc: Exception) -> Any:
        """An API error as the server sends it (a Status object), without KMock's traceback in `details`."""
        if isinstance(exc, kmock.KubernetesError):
            import aiohttp.web

            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": exc.status,
                "reason": exc.reason or "", "message": exc.message or "", "details": exc.details or {},
            }, status=exc.status)
        return await super()._render_error(exc)

    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _namespaced(self, resource: Any) -> bool:
        return resource in self.resources and self.resources[resource].namespaced is not False

    def refuse(self, plural: str, namespace: str | None, status: int, reason: str, message: str,
               times: int | None = None) -> Callable[[], None]:
        """Refuse creates of `plural` in `namespace` with an API error, `times` times (None: until lifted); returns
        the function that lifts the refusal."""
        left = [times]

        def hook(request: kmock.Request, obj: dict) -> None:
            if request.resource.plural != plural or request.namespace != namespace or left[0] == 0:
                return
            if left[0] is not None:
                left[0] -= 1
            raise kmock.KubernetesError(status, reason, message)

        self.admission.append(hook)
        return lambda: self.admission.remove(hook) if hook in self.admission else None

    def refuse_update(self, plural: str, namespace: str | None, name: str, status: int, reason: str, message: str,
                      *, subresource: str | None = None, times: int = 1) -> Callable[[], int]:
        """Refuse `times` PATCHes of object `name` (of its `subresource`, e.g. status) with an API error — what a
        writer sees when another write won (409 Conflict); returns how many were refused so far."""
        refused = [0]

        def hook(request: kmock.Request, patch: Any) -> None:
            if (request.resource.plural, request.namespace, request.name, request.subresource or None) != (
                    plural, namespace, name, subresource) or refused[0] >= times:
                return
            refused[0] += 1
            raise kmock.KubernetesError(status, reason, message)

        self.update_admission.append(hook)
        return lambda: refused[0]

    def enforce_owner_references(self, rules: list[dict]) -> Callable[[], None]:
        """The OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) for a client holding `rules`
        (RBAC PolicyRules): an ownerReference with blockOwnerDeletion needs `update` on the owner's finalizers
        subresource, else the create is refused with 403. Returns the function that turns it off."""
        def plural_of(api_version: str, kind: str) -> str:
            group, _, version = api_version.rpartition("/")
            for res, info in self.resources.items():
                if res.group == group and res.version == version and info.kind == kind and "/" not in res.plural:
                    return res.plural
            return kind.lower() + "s"

        def hook(request: kmock.Request, obj: dict) -> None:
            for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
                if not ref.get("blockOwnerDeletion"):
                    continue
                group = ref["apiVersion"].rpartition("/")[0]
                resource = plural_of(ref["apiVersion"], ref["kind"]) + "/finalizers"
                if not any(group in r["apiGroups"] and resource in r["resources"] and "update" in r["verbs"]
                           for r in rules):
                    raise kmock.KubernetesError(403, "Forbidden", (
                        f"{request.resource.plural} {obj['metadata'].get('name')!r} is forbidden: cannot set "
                        "blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on: "
                        f"cannot update resource {resource!r} in API group {group!r}"))

        self.admission.append(hook)
        return lambda: self.admission.remove(hook) if hook in self.admission else None

    async def _handle(self, request: kmock.Request) -> Any:
        client = request.headers.get("User-Agent", "?").split("/")[0]
        self.clients[client] += 1
        if request.headers.get("Authorization"):
            self.authorization[client].add(request.headers["Authorization"])
        if request.resource is not None and request.resource not in self.resources and request.resource.plural:
            # A real API server answers 404 for a group/version/resource it does not serve (e.g. a PodGroup without
            # Volcano installed); KMock would store it.
            return await self._render_error(kmock.KubernetesError(
                404, "NotFound", "the server could not find the requested resource"))
        if request.action == action.WATCH and request.resource is not None:
            key = f"{request.resource.group}/{request.resource.version}/{request.resource.plural}"
            self.watched.add(key)
            self.watch_params[key] = dict(request.params)
        if request.resource is not None and request.action in (
            action.CREATE, action.UPDATE, action.DELETE
        ):
            try:
                async with self._lock:
                    events = self._mutate(request)
            except kmock.KubernetesError as exc:
                return await self._render_error(exc)
            for resource, event in events:
                await self._buses[resource].put(event)
        # Skip KubernetesEmulator._handle's own mutation and serve the stored state. Object requests go straight to
        # the serving functions: KMock's reaction matching scans the whole request log per request (quadratic).
        serve = {
            action.LIST: self._serve_list, action.WATCH: self._serve_watch,
            action.FETCH: self._serve_fetch, action.CREATE: self._serve_create,
            action.UPDATE: self._serve_update, action.DELETE: self._serve_delete,
        }.get(request.action) if request.resource is not None and request.resource.plural else None
        if serve is not None:
            try:
                return await kmock.Response.guess(serve)(request)
            except kmock.KubernetesError as exc:
                return await self._render_error(exc)
        return await kmock.RawHandler._handle(self, request)

    # ---------------------------------------------------------------------------------------------- mutation
    def _mutate(self, req: kmock.Request) -> list[tuple[Any, dict]]:
        res = req.resource
        if req.action == action.CREATE:
            if req.subresource:
                return []
            if isinstance(req.data, dict):
                for hook in list(self.admission):
                    hook(req, req.data)
            return self._create(req)
        key = (res, req.namespace, req.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesError(404, "NotFound", f"{res.plural} {req.name!r} not found")
        if req.action == action.DELETE:
            return self._delete(key)
        for hook in list(self.update_admission):
            hook(req, req.data)
        return self._patch(key, req)

    def _create(self, req: kmock.Request) -> list[tuple[Any, dict]]:
        res = req.resource
        obj = req.data
        if not isinstance(obj, dict):
            raise kmock.KubernetesError(400, "BadRequest", "the body must be a JSON object")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise kmock.KubernetesError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        namespace = (req.namespace or meta.get("namespace")) if self._namespaced(res) else None
        if namespace is not None:
            meta["namespace"] = namespace
        key = (res, namespace, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise kmock.KubernetesError(409, "AlreadyExists", f"{res.plural} {meta['name']!r} already exists")
        for k in ("deletionTimestamp", "resourceVersion", "uid"):
            meta.pop(k, None)
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)), generation=1,
                    creationTimestamp=_now())
        if res.group == "" and res.plural == "pods":
            obj["status"] = {"phase": "Pending"}
        elif self._has_status(res):
            obj.pop("status", None)
        self._validate(res, obj)
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        return [(res, {"type": "ADDED", "object": copy.deepcopy(obj)})]

    def _patch(self, key: tuple, req: kmock.Request) -> list[tuple[Any, dict]]:
        res = key[0]
        old = copy.deepcopy(self._objects[key].raw)
        if isinstance(req.data, dict):  # a merge patch: its resourceVersion is a precondition
            want = (req.data.get("metadata") or {}).get("resourceVersion")
            if want is not None and str(want) != old["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(
                    409, "Conflict", "the object has been modified; please apply your changes to the latest version"
                )
        patched = kmock.Object(copy.deepcopy(old))
        try:
            patched.patch(req.data if isinstance(req.data, (dict, list)) else {})
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(422, "Invalid", f"the server rejected our request: {exc}") from None
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise kmock.KubernetesError(422, "Invalid", str(exc)) from None
        new = copy.deepcopy(patched.raw)
        if req.subresource == "status":
            new = {**old, "status": new.get("status")} if new.get("status") is not None else {
                k: v for k, v in old.items() if k != "status"}
        elif req.subresource == "scale":
            new = self._scaled(res, old, req.data)
        elif req.subresource:
            raise kmock.KubernetesError(405, "MethodNotAllowed", f"subresource {req.subresource} not emulated")
        elif self._has_status(res):
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        meta = new.setdefault("metadata", {})
        for k in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if k in old["metadata"]:
                meta[k] = old["metadata"][k]
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if old.get("metadata", {}).get("deletionTimestamp"):
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
        if new == old:
            return []
        self._validate(res, new)
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }:
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = str(next(self._rv))
        self._objects[key].history.append(new)
        events = [(res, {"type": "MODIFIED", "object": copy.deepcopy(new)})]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            events += self._remove(key)
        return events

    def _scale_paths(self, res: Any) -> dict:
        paths = self.scales.get((res.group, res.version, res.plural))
        if paths is None:
            raise kmock.KubernetesError(404, "NotFound", f"{res.plural} has no scale subresource")
        return paths

    def _scaled(self, res: Any, old: dict, patch: Any) -> dict:
        """`old` with the replicas of a merge patch of its Scale (`{"spec": {"replicas": N}}`) at specReplicasPath."""
        if not isinstance(patch, dict):
            raise kmock.KubernetesError(415, "UnsupportedMediaType", "the scale subresource is emulated for merge "
                                        "patches only")
        replicas = (patch.get("spec") or {}).get("replicas")
        new = copy.deepcopy(old)
        if replicas is None:
            return new
        *parents, leaf = self._scale_paths(res)["specReplicasPath"].strip(".").split(".")
        node = new
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = replicas
        return new

    def _scale_of(self, res: Any, obj: dict) -> dict:
        """The autoscaling/v1 Scale of `obj` (the CRD's specReplicasPath, statusReplicasPath, labelSelectorPath)."""
        paths = self._scale_paths(res)
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": _json_path(obj, paths["statusReplicasPath"]) or 0}
        if paths.get("labelSelectorPath") and _json_path(obj, paths["labelSelectorPath"]):
            status["selector"] = _json_path(obj, paths["labelSelectorPath"])
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": _json_path(obj, paths["specReplicasPath"])}, "status": status}

    async def _serve_update(self, request: kmock.Request) -> Any:
        result = await super()._serve_update(request)
        return self._scale_of(request.resource, result) if request.subresource == "scale" else result

    def _validate(self, res: Any, obj: dict) -> None:
        """A custom resource against its CRD's openAPIV3Schema (OpenAPI 3.0: draft-4 keywords such as a boolean
        exclusiveMinimum), as the API server validates every write (including
        status subresource writes): 422 Invalid naming the field."""
        schema = self.schemas.get((res.group, res.version, res.plural))
        if schema is None:
            return
        body = {k: v for k, v in obj.items() if k != "metadata"}
        error = next(iter(sorted(jsonschema.Draft4Validator(schema).iter_errors(body), key=lambda e: list(e.path))),
                     None)
        if error is not None:
            where = ".".join(str(p) for p in error.path) or "<root>"
            raise kmock.KubernetesError(422, "Invalid", f"{res.plural} {obj['metadata'].get('name')!r} is invalid: "
                                        f"{where}: Invalid value: {error.message[:200]}")

    def _delete(self, key: tuple) -> list[tuple[Any, dict]]:
        obj = self._objects[key].raw
        meta = obj.get("metadata", {})
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return []
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["resourceVersion"] = str(next(self._rv))
            self._objects[key].history.append(new)
            return [(key[0], {"type": "MODIFIED", "object": copy.deepcopy(new)})]
        return self._remove(key)

    def _remove(self, key: tuple) -> list[tuple[Any, dict]]:
        """Delete for real, then garbage-collect dependents (background propagation)."""
        raw = copy.deepcopy(self._objects[key].raw)
        self._objects[key].delete()
        events = [(key[0], {"type": "DELETED", "object": raw})]
        uid = raw.get("metadata", {}).get("uid")
        for other_key, other in list(self._objects.items()):
            if other.deleted:
                continue
            refs = other.raw.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                events += self._delete(other_key)
        return events

    # ---------------------------------------------------------------------------------------------- reading
    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        res = request.resource
        info = self.resources[res] if res in self.resources else None
        kind = info.kind if info is not None and info.kind else (res.plural or "").capitalize()
        result["kind"] = f"{kind}List"
        result["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
        result["metadata"] = {"resourceVersion": str(next(self._rv))}
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [o for o in result["items"]
                               if _selector_matches(selector, o.get("metadata", {}).get("labels") or {})]
        for item in result["items"]:
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", result["apiVersion"])
        columns = self.printer_columns.get((res.group, res.version, res.plural))
        if columns and _wants_table(request):
            return _table(columns, result["items"], result["metadata"]["resourceVersion"])
        return result

    async def _serve_watch(self, request: kmock.Request) -> Any:
        """KMock's watch stream, filtered by the request's labelSelector as the API server does."""
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if selector and isinstance(event, dict) and not _selector_matches(
                    selector, ((event.get("object") or {}).get("metadata") or {}).get("labels") or {}):
                continue
            yield event

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        result = await super()._serve_fetch(request)
        res = request.resource
        if request.subresource == "scale":
            return self._scale_of(res, result)
        columns = self.printer_columns.get((res.group, res.version, res.plural))
        if columns and _wants_table(request) and isinstance(result, dict):
            return _table(columns, [result], result["metadata"]["resourceVersion"])
        return result

    async def _serve_version(self, request: kmock.Request) -> Any:
        result = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            result["groupVersion"] = request.resource.version
        for entry in result.get("resources", []):
            if "/" in entry["name"]:  # a subresource: the real API server lists no short names/categories for it
                entry.update(shortNames=[], categories=[], singularName="")
        return result


def _wants_table(request: kmock.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


def _json_path(obj: Any, path: str) -> Any:
    """A CRD printer column's simple JSON path (`.status.phase`, `.a[0].b`); None when absent."""
    for part in path.strip(".").replace("[", ".[").split("."):
        if not part:
            continue
        if part.startswith("[") and part.endswith("]") and part[1:-1].isdigit():
            idx = int(part[1:-1])
            obj = obj[idx] if isinstance(obj, list) and idx < len(obj) else None
        else:
            obj = obj.get(part) if isinstance(obj, dict) else None
        if obj is None:
            return None
    return obj


def _age(timestamp: str) -> str:
    """Like the API server's human-readable durations (5s, 2m10s, 45m, 3h4m, 26h, 3d4h, 12d)."""
    then = dt.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    s = max(int((dt.datetime.now(dt.timezone.utc) - then).total_seconds()), 0)
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if h < 3:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if d < 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    return f"{d}d"


def _table(columns: list[dict], items: list[dict], resource_version: str) -> dict:
    """A meta.k8s.io/v1 Table the way the API server renders a custom resource (Name, then the printer columns)."""
    defs = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
             "description": "Name must be unique within a namespace."}]
    defs += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""), "priority": c.get("priority", 0),
              "description": c.get("description", "")} for c in columns]
    rows = []
    for item in items:
        cells: list[Any] = [item["metadata"]["name"]]
        for c in columns:
            value = _json_path(item, c["jsonPath"])
            if value is not None and c["type"] == "date":
                value = _age(value)
            elif value is not None and c["type"] == "string" and not isinstance(value, str):
                value = json.dumps(value)
            cells.append(value)
        rows.append({"cells": cells, "object": item})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": defs, "rows": rows}


def register_resources(emulator: FidelityEmulator, crd_path: Path = CRD_PATH) -> dict[str, Any]:
    """Built-in resources (KMock's bundle) + the TrainingRun CRD; returns the CRD object."""
    emulator.resources.load_bundled()
    crd = yaml.safe_load(crd_path.read_text())
    spec = crd["spec"]
    for version in spec["versions"]:
        key = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
        emulator.resources[key] = kmock.ResourceInfo(
            kind=spec["names"]["kind"],
            singular=spec["names"].get("singular"),
            namespaced=spec["scope"] == "Namespaced",
            shortnames=set(spec["names"].get("shortNames", [])),
            categories=set(spec["names"].get("categories", [])),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources=set((version.get("subresources") or {}).keys()),
        )
        emulator.schemas[(spec["group"], version["name"], spec["names"]["plural"])] = (
            version["schema"]["openAPIV3Schema"])
        if (version.get("subresources") or {}).get("scale"):
            emulator.scales[(spec["group"], version["name"], spec["names"]["plural"])] = (
                version["subresources"]["scale"])
        if version.get("additionalPrinterColumns"):
            emulator.printer_columns[(spec["group"], version["name"], spec["names"]["plural"])] = (
                version["additionalPrinterColumns"])
    return crd


def pod_uids(pods: list[dict]) -> dict[str, str]:
    """{name: uid} of `pods` — what a test compares to say that pods were kept (not replaced)."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


class Cluster:
    """The emulator served on 127.0.0.1 from a background thread, with a synchronous HTTP client for tests."""

    def __init__(self, crd_path: Path = CRD_PATH):
        self.crd_path = crd_path
        self.emulator: FidelityEmulator | None = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="trainingrun-kube-")
        self.kubeconfig = Path(self._tmp.name) / "kubeconfig"

    def __enter__(self) -> Cluster:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            try:
                self.emulator = FidelityEmulator()
                crd = register_resources(self.emulator, self.crd_path)
                self._stop = asyncio.Event()
                async with self.emulator, kmock.Server(self.emulator, host="127.0.0.1", port=free_port()) as server:
                    self.url = str(server.url).rstrip("/")
                    ready.set()
                    self._crd = crd
                    await self._stop.wait()
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                errors.append(exc)
                ready.set()

        def target() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(main())
            self._loop.close()

        self._thread = threading.Thread(target=target, name="kube-emulator", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator",
                                                          "namespace": "default"}}],
        }))
        self.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", self._crd)
        self.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}})
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)
        self._tmp.cleanup()

    # --- synchronous HTTP API (real requests to the emulator)
    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json",
                                              "User-Agent": "tests/1"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                text = r.read()
        except urllib.error.HTTPError as exc:
            exc.body = exc.read().decode(errors="replace")  # type: ignore[attr-defined]
            raise
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def live_pod(self, name: str, namespace: str = "default") -> dict | None:
        """The pod `name`, None when it is absent or being deleted."""
        pod = self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        return None if pod is None or pod["metadata"].get("deletionTimestamp") else pod

    def create(self, path: str, obj: dict) -> Any:
        return self.request("POST", path, obj)

    def patch(self, path: str, patch: Any, *, json_patch: bool = False) -> Any:
        ctype = "application/json-patch+json" if json_patch else "application/merge-patch+json"
        return self.request("PATCH", path, patch, ctype)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def items(self, path: str, selector: str | None = None) -> list[dict]:
        query = f"?labelSelector={urllib.request.quote(selector)}" if selector else ""
        return self.request("GET", path + query)["items"]

    # --- TrainingRun / pod helpers
    def tr_path(self, name: str | None = None, ns: str = "default") -> str:
        return f"/apis/{API_VERSION}/namespaces/{ns}/{PLURAL}" + (f"/{name}" if name else "")

    def run(self, name: str, ns: str = "default") -> dict | None:
        return self.get(self.tr_path(name, ns))

    def pods(self, run: str, ns: str = "default", **labels: str) -> list[dict]:
        keys = {"role": LABEL_ROLE, "rank": LABEL_RANK, "attempt": LABEL_ATTEMPT}
        selector = ",".join([f"{LABEL_RUN}={run}"] + [f"{keys[k]}={v}" for k, v in labels.items()])
        return self.items(f"/api/v1/namespaces/{ns}/pods", selector)

    def events(self, name: str, ns: str = "default") -> list[dict]:
        return [e for e in self.items(f"/api/v1/namespaces/{ns}/events")
                if (e.get("involvedObject") or {}).get("name") == name]

    def set_pod(self, name: str, phase: str, *, exit_code: int | None = None, reason: str | None = None,
                ns: str = "default", container: str | None = None, pod_reason: str | None = None) -> Any:
        """What a kubelet would report: the pod phase, and for terminated pods the container's exit code/reason
        (`pod_reason`: the pod's own status.reason, e.g. Evicted for a node-pressure eviction)."""
        pod = self.get(f"/api/v1/namespaces/{ns}/pods/{name}")
        cname = container or pod["spec"]["containers"][0]["name"]
        status: dict[str, Any] = {"phase": phase}
        if pod_reason:
            status["reason"] = pod_reason
            status["message"] = f"The node was low on resource: memory. ({pod_reason})"
        if phase == "Running":
            status["containerStatuses"] = [{"name": cname, "ready": True, "restartCount": 0,
                                            "state": {"running": {"startedAt": _now()}}}]
        elif phase in ("Succeeded", "Failed"):
            code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
            status["containerStatuses"] = [{"name": cname, "ready": False, "restartCount": 0, "state": {
                "terminated": {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                               "finishedAt": _now()}}}]
        return self.patch(f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status})

    def history(self, plural: str, name: str, ns: str | None = "default") -> list[dict]:
        """Every stored version of an object, also after it was deleted (KMock keeps them)."""
        assert self.emulator is not None
        for (res, namespace, obj_name), obj in self.emulator.objects.items():
            if res.plural == plural and namespace == ns and obj_name == name:
                return [v.raw for v in obj.history if v is not None]
        return []

    # --- scenario helpers (tests/integration/test_operator*.py)
    def new_run(self, name: str, ns: str = "default", **spec: Any) -> dict:
        """examples/tiny.yaml as `name` in `ns` with backoffSeconds 0 and the given spec fields replaced."""
        doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": ns}
        doc["spec"]["failurePolicy"]["backoffSeconds"] = 0
        doc["spec"].update(spec)
        if ns != "default" and self.get(f"/api/v1/namespaces/{ns}") is None:
            self.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        return self.create(self.tr_path(ns=ns), doc)

    def status(self, name: str, ns: str = "default") -> dict:
        return (self.run(name, ns) or {}).get("status") or {}

    def condition(self, name: str, type_: str, ns: str = "default") -> dict:
        return next((c for c in self.status(name, ns).get("conditions") or [] if c.get("type") == type_), {})

    def wait_phase(self, name: str, phase: str, ns: str = "default", timeout: float = 15) -> dict:
        return wait_for(lambda: self.status(name, ns) if self.status(name, ns).get("phase") == phase else None,
                        timeout, f"{name} phase {phase} (now {self.status(name, ns)})")

    def group_pods(self, name: str, attempt: int, ns: str = "default") -> list[dict]:
        """The rollout and trainer pods of one attempt that are not being deleted."""
        return [p for p in self.pods(name, ns, attempt=str(attempt)) if not p["metadata"].get("deletionTimestamp")]

    def wait_group(self, name: str, attempt: int, n: int = 3, ns: str = "default", timeout: float = 15) -> list[dict]:
        return wait_for(lambda: (lambda ps: ps if len(ps) == n else None)(self.group_pods(name, attempt, ns)),
                        timeout, f"{n} pods of {name} attempt {attempt}")

    def run_all(self, name: str, attempt: int, ns: str = "default", n: int = 3) -> None:
        """Every pod of the attempt Running (as the kubelet reports it), then wait for phase Running."""
        for pod in self.wait_group(name, attempt, n, ns):
            self.set_pod(pod["metadata"]["name"], "Running", ns=ns)
        self.wait_phase(name, "Running", ns)

    def reasons(self, name: str, ns: str = "default") -> list[str]:
        return [e.get("reason") for e in self.events(name, ns)]

    def evict(self, pod: str, ns: str = "default", reason: str = "EvictionByEvictionAPI") -> None:
        """What the Eviction API (kubectl drain) does: condition DisruptionTarget=True, then delete the pod."""
        path = f"/api/v1/namespaces/{ns}/pods/{pod}"
        conditions = (self.get(path).get("status") or {}).get("conditions") or []
        self.patch(path + "/status", {"status": {"conditions": [*conditions, {
            "type": "DisruptionTarget", "status": "True", "reason": reason,
            "message": "Eviction API: evicting", "lastTransitionTime": _now()}]}})
        self.delete(path)

    def operator_ready(self) -> bool:
        assert self.emulator is not None
        return {f"{TR}", "/v1/pods"} <= self.emulator.watched

    def operator(self, interval: float = 1.0) -> InProcessOperator:
        """The operator's kopf handlers run in this process against this emulator (see `InProcessOperator`)."""
        return InProcessOperator(self, interval=interval)

    def start_operator(self, *args: str, interval: float = 1.0, log: Path | None = None,
                       kubeconfig: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """The real operator (`python -m trainingrun operator`) against this emulator; returns once it watches."""
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        args = ("--bind", "127.0.0.1", "--metrics-port", self.metrics_url.split(":")[2].split("/")[0], *args)
        out = open(log, "ab") if log else subprocess.DEVNULL
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainingrun", "operator", "--standalone", "--interval", str(interval),
             "--liveness-port", "0", *args],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        assert self.emulator is not None
        self.emulator.watched.clear()
        try:
            wait_for(lambda: self.operator_ready() or proc.poll() is not None, 60, "the operator to watch")
        except TimeoutError:
            stop_process(proc)
            raise
        if proc.poll() is not None:
            raise RuntimeError(f"operator exited with {proc.returncode} (log: {log})")
        return proc


class InProcessOperator:
    """`trainingrun.operator.handlers` run by `kopf.operator()` in a thread of the test process (what
    `kopf.testing.KopfTask`/`KopfThread` do in newer kopf releases; 1.45 has neither), logged in through the
    cluster's kubeconfig. Starts in well under a second (no interpreter to start); kopf takes ~5 s to stop.

    `restart()` stops it and starts it again with a new operator memo (`handlers.operator_memo`): every in-memory
    cache is forgotten, as a new process would have it. `reconciles(name)` counts the finished reconciles of a run, so a test can prove the operator
    looked at a run again before asserting that something did *not* change.
    """

    def __init__(self, cluster: Cluster, interval: float = 1.0):
        self.cluster = cluster
        self.interval = interval
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self.error: BaseException | None = None
        self.memo: Any = None  # the running operator's kopf memo (its `state`: handlers.OperatorState)

    def __enter__(self) -> InProcessOperator:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        import kopf

        from trainingrun.operator import handlers

        os.environ["KUBECONFIG"] = str(self.cluster.kubeconfig)
        self.memo = memo = handlers.operator_memo(interval=self.interval)
        self._stop = threading.Event()
        stop = self._stop
        assert self.cluster.emulator is not None
        self.cluster.emulator.watched.clear()

        def target() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, memo=memo))
            except BaseException as exc:  # noqa: BLE001 - reported by wait_ready / stop
                self.error = exc
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=target, name="operator", daemon=True)
        self._thread.start()
        wait_for(lambda: self.cluster.operator_ready() or self.error is not None or not self._thread.is_alive(),
                 60, "the in-process operator to watch")
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the operator stopped: {self.error!r}")

    def stop(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(60)
            self._thread = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def reconciles(self, name: str, ns: str = "default") -> int:
        return self.memo.state.reconciles.get((ns, name), 0) if self.memo is not None else 0

    def settle(self, name: str, ns: str = "default", count: int = 2, timeout: float = 15) -> None:
        """Wait until the run was reconciled `count` more times (its state was looked at again)."""
        target = self.reconciles(name, ns) + count
        wait_for(lambda: self.reconciles(name, ns) >= target, timeout, f"{count} more reconciles of {name}")
