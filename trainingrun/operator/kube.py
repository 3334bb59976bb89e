"""The operator's Kubernetes credentials and its own API calls, through the official `kubernetes` client.

Credentials (`load_configuration`): `$KUBECONFIG` when set, else the in-cluster service account, else the default
kubeconfig — loaded by `kubernetes.config`, so everything it understands works: exec credential plugins (cloud
logins; tokens refreshed when they expire), token files, client certificates, `proxy-url`, `tls-server-name`. The
same configuration logs kopf in (`connection_info`), so kopf's watches and our calls use one identity. Temporary
files the client writes for certificate/key data are its own and removed at exit; this module writes none.

Calls (`KubeApi`): create (409 AlreadyExists → False: create-if-missing), delete (404 → False), JSON merge patch (a
`metadata.resourceVersion` in it is a precondition: 409 `Conflict` on a stale one), get. Each runs in a bounded
thread pool (`workers`), so the async daemons never block on the network and at most `workers` requests are in
flight. 429 and 5xx answers, and connection errors, are retried with exponential backoff honouring `Retry-After`
(at most `retries` times, never waiting longer than `max_wait` seconds at once); every other error raises
`ApiError` with the HTTP status and the server's message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3

from trainingrun import __version__

log = logging.getLogger(__name__)

USER_AGENT = f"trainingrun-operator/{__version__}"
PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events",
           "PodGroup": "podgroups", "Workload": "workloads", "TrainingRun": "trainingruns"}


class ApiError(RuntimeError):
    """A failed API call: `status` is the HTTP status (0: no answer), `detail` the server's message."""

    def __init__(self, status: int, method: str, path: str, detail: str, reason: str = ""):
        self.status = status
        self.method = method
        self.path = path
        self.reason = reason
        self.detail = detail
        super().__init__(f"{method} {path}: HTTP {status}{' ' + reason if reason else ''}: {detail}")


class Conflict(ApiError):
    """409: the object changed since it was observed (or already exists)."""


def load_configuration(kubeconfig: str | None = None):
    """A `kubernetes.client.Configuration`: `kubeconfig` or $KUBECONFIG when given, else in-cluster, else the
    default kubeconfig. Raises `kubernetes.config.ConfigException` when none works."""
    import kubernetes.client  # deferred: kubernetes (the operator only)
    import kubernetes.config  # deferred: kubernetes

    cfg = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path:
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
            return cfg
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
    return cfg


def bearer_token(cfg) -> str | None:
    """The configuration's current bearer token (refreshing an expired exec-plugin or service-account token)."""
    header = cfg.get_api_key_with_prefix("BearerToken", alias="authorization")
    if not header:
        return None
    return header.split(" ", 1)[1] if " " in header else header


def connection_info(cfg, *, trust_env: bool = False):
    """kopf's credentials from a client configuration."""
    import kopf  # deferred: kopf (the operator only)

    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme="Bearer" if bearer_token(cfg) else None,
        token=bearer_token(cfg),
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        proxy_url=cfg.proxy or None,
        trust_env=trust_env,
    )


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    tail = f"/{name}" if name else ""
    sub = f"/{subresource}" if subresource else ""
    return f"{base}{ns}/{plural}{tail}{sub}"


def plural_of(kind: str) -> str:
    return PLURALS.get(kind) or kind.lower() + "s"


class KubeApi:
    """The operator's API client (one per process): create, delete, patch, get. Counts its requests."""

    def __init__(self, cfg, *, workers: int = 8, timeout: float = 15.0, retries: int = 4, max_wait: float = 30.0):
        import kubernetes.client  # deferred: kubernetes (the operator only)

        cfg.connection_pool_maxsize = workers
        self.client = kubernetes.client.ApiClient(cfg)
        self.client.user_agent = USER_AGENT
        self.timeout = timeout
        self.retries = retries
        self.max_wait = max_wait
        self.requests = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube-api")

    # -- async API (the calls run in the pool)
    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists; True if created, False if it already existed."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], plural_of(obj["kind"]), meta.get("namespace"))
        try:
            await self._run("POST", path, obj)
            return True
        except Conflict:
            return False

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete (background propagation); True if it was there."""
        path = object_path(api_version, plural_of(kind), namespace, name)
        try:
            await self._run("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1",
                                             "propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
                    *, subresource: str | None = None) -> Any:
        """JSON merge patch; a `metadata.resourceVersion` in the patch is a precondition (Conflict on mismatch)."""
        path = object_path(api_version, plural_of(kind), namespace, name, subresource)
        return await self._run("PATCH", path, patch, "application/merge-patch+json")

    async def get(self, path: str) -> Any:
        return await self._run("GET", path)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    async def _run(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.call, method, path, body, content_type)

    # -- one call (in a pool thread)
    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """One API call with retries of 429/5xx/connection errors; the decoded JSON answer."""
        for attempt in range(self.retries + 1):
            headers = {"Accept": "application/json", "Content-Type": content_type}
            _, url, headers, data, _ = self.client.param_serialize(
                method=method, resource_path=path, header_params=headers, body=body, auth_settings=["BearerToken"])
            self.requests += 1
            try:
                response = self.client.call_api(method, url, header_params=headers, body=data,
                                                _request_timeout=self.timeout)
                response.read()
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if attempt < self.retries:
                    self._sleep(None, attempt, f"{method} {path}: {exc}")
                    continue
                raise ApiError(0, method, path, f"no answer from the API server: {exc}") from exc
            except Exception as exc:  # kubernetes.client.ApiException (status 0: SSL), anything odd
                raise ApiError(getattr(exc, "status", 0) or 0, method, path, str(exc)) from exc
            status = response.status
            text = response.data.decode("utf-8", "replace") if response.data else ""
            if (status == 429 or status >= 500) and attempt < self.retries:
                self._sleep(response.getheader("Retry-After"), attempt, f"{method} {path}: HTTP {status}")
                continue
            if status >= 400:
                reason, detail = _status_message(text)
                cls = Conflict if status == 409 else ApiError
                raise cls(status, method, path, detail, reason)
            return json.loads(text) if text else None
        raise AssertionError("unreachable")

    def _sleep(self, retry_after: str | None, attempt: int, what: str) -> None:
        delay = min(0.2 * 2 ** attempt, self.max_wait)
        if retry_after:
            try:
                delay = min(max(float(retry_after), 0.0), self.max_wait)
            except ValueError:
                pass
        log.debug("%s: retrying in %.1fs", what, delay)
        time.sleep(delay)


def _status_message(text: str) -> tuple[str, str]:
    """(reason, message) of a Kubernetes Status answer (or the raw text)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return "", text[:2000]
    if not isinstance(doc, dict):
        return "", text[:2000]
    return str(doc.get("reason") or ""), str(doc.get("message") or text)[:8000]
