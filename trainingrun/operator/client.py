"""A small async Kubernetes API client for the operator's own calls (create, delete, status patch), on aiohttp with
the credentials of kopf's login (`kopf.ConnectionInfo`), so the operator needs no extra client library.

Every call has a timeout; `create` treats 409 AlreadyExists as success (idempotent create-if-missing); `delete`
treats 404 as success; `patch_status` sends the observed resourceVersion as a precondition, so a status computed from
a stale observation is rejected (409) instead of overwriting a newer one.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from typing import Any

import aiohttp

CORE_PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events"}


class ApiError(RuntimeError):
    """A failed API call; `status` is the HTTP status, the message names method, path and the server's reason."""

    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        try:
            detail = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            detail = body
        self.detail = str(detail)[:300]  # the server's reason, e.g. 'pods "x" is forbidden: exceeded quota: ...'
        super().__init__(f"{method} {path}: HTTP {status}: {self.detail}")


class Conflict(ApiError):
    """409: the object changed since it was observed (or already exists)."""


def _plural(kind: str) -> str:
    return CORE_PLURALS.get(kind) or kind.lower() + "s"


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None, plural: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    tail = f"/{name}" if name else ""
    return f"{base}{ns}/{plural or _plural(kind)}{tail}"


class KubeClient:
    """Async API client; one per operator process. Counts requests (for the operator's benchmark and metrics)."""

    def __init__(self, server: str, *, token: str | None = None, headers: dict[str, str] | None = None,
                 ssl_context: ssl.SSLContext | bool | None = None, timeout: float = 15.0):
        self.server = server.rstrip("/")
        self.headers = {"Accept": "application/json", "User-Agent": "trainingrun-operator/0.1", **(headers or {})}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0

    @classmethod
    def from_connection_info(cls, info: Any, timeout: float = 15.0) -> KubeClient:
        """From a `kopf.ConnectionInfo` (token, basic auth or client certificate; CA path or data)."""
        headers: dict[str, str] = {}
        token = None
        if info.token:
            token = info.token if (info.scheme or "Bearer") == "Bearer" else None
            if token is None:
                headers["Authorization"] = f"{info.scheme} {info.token}"
        elif info.username and info.password:
            raw = f"{info.username}:{info.password}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
        ctx: ssl.SSLContext | bool | None = None
        if info.server.startswith("https"):
            if info.insecure:
                ctx = False
            else:
                ctx = ssl.create_default_context()
                if info.ca_path:
                    ctx.load_verify_locations(cafile=os.fspath(info.ca_path))
                elif info.ca_data:
                    ctx.load_verify_locations(cadata=_pem(info.ca_data).decode())
            cert, key = info.certificate_path, info.private_key_path
            if info.certificate_data or info.private_key_data:
                cert, key = _to_file(info.certificate_data), _to_file(info.private_key_data)
            if cert and isinstance(ctx, ssl.SSLContext):
                ctx.load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
        return cls(info.server, token=token, headers=headers, ssl_context=ctx, timeout=timeout)

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        self.requests += 1
        headers = dict(self.headers)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._session.request(method, self.server + path, data=data, headers=headers, ssl=self._ssl) as r:
            text = await r.text()
            if r.status == 409:
                raise Conflict(r.status, method, path, text)
            if r.status >= 400:
                raise ApiError(r.status, method, path, text)
            return json.loads(text) if text else None

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists; True if created, False if it already existed."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        try:
            await self._request("POST", path, obj)
            return True
        except Conflict:
            return False

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
                     plural: str | None = None) -> bool:
        """Delete (background propagation); True if it was there."""
        path = object_path(api_version, kind, namespace, name, plural)
        try:
            await self._request("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1",
                                                 "propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
                    *, plural: str | None = None, subresource: str | None = None) -> Any:
        """JSON merge patch; a `metadata.resourceVersion` in the patch is a precondition (409 on mismatch)."""
        path = object_path(api_version, kind, namespace, name, plural) + (f"/{subresource}" if subresource else "")
        return await self._request("PATCH", path, patch, "application/merge-patch+json")

    async def get(self, path: str) -> Any:
        return await self._request("GET", path)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _pem(data: str | bytes) -> bytes:
    """PEM bytes from kubeconfig-style data: base64 of PEM (as in kubeconfig *-data fields) or PEM itself."""
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----BEGIN") else base64.b64decode(raw)


def _to_file(data: str | bytes | None) -> str | None:
    if not data:
        return None
    raw = _pem(data)
    f = tempfile.NamedTemporaryFile(prefix="trainingrun-op-", suffix=".pem", delete=False)
    f.write(raw)
    f.close()
    os.chmod(f.name, 0o600)
    return f.name
