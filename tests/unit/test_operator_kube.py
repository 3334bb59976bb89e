"""The operator's API client on the official `kubernetes` package (trainingrun.operator.kube): credentials from a
kubeconfig token file, the in-cluster service account and a proxy; retries of 429/5xx honouring Retry-After; errors
with the server's message; calls offloaded to a bounded pool. Against small real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from contextlib import contextmanager

import pytest
import yaml

from trainingrun.operator import kube


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers from `script` (a list of (status, headers, body) consumed in order, the last one repeated) and
    records (method, path, headers, body) of every request."""

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self._answer()

    def do_PATCH(self):
        self._answer()

    def do_DELETE(self):
        self._answer()

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        server = self.server
        with server.lock:
            server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            status, headers, answer = server.script[0] if len(server.script) == 1 else server.script.pop(0)
            server.active += 1
            server.peak = max(server.peak, server.active)
        time.sleep(server.delay)
        with server.lock:
            server.active -= 1  # before answering: the client's next request cannot overlap this one
        data = json.dumps(answer).encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextmanager
def server(script, delay=0.0):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    srv.script, srv.seen, srv.lock, srv.delay, srv.active, srv.peak = list(script), [], threading.Lock(), delay, 0, 0
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()


def kubeconfig(tmp_path, url, user):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return str(path)


def url_of(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}"


def status(code, reason, message):
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def test_token_file_login_retries_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    token = tmp_path / "token"
    token.write_text("from-a-file")
    script = [(429, {"Retry-After": "1"}, status(429, "TooManyRequests", "slow down")),
              (503, {}, status(503, "ServiceUnavailable", "etcd leader changed")),
              (201, {}, {"metadata": {"name": "p"}})]
    with server(script) as srv:
        cfg = kube.load_configuration(kubeconfig(tmp_path, url_of(srv), {"tokenFile": str(token)}))
        info = kube.connection_info(cfg)
        assert info.server == url_of(srv) and info.token == "from-a-file" and info.scheme == "Bearer"
        api = kube.KubeApi(cfg, workers=2, retries=4)
        t0 = time.monotonic()
        created = asyncio.run(api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p",
                                                                                          "namespace": "ns"}}))
        assert created and time.monotonic() - t0 >= 1.0  # waited the Retry-After second
        assert [(m, p) for m, p, _, _ in srv.seen] == [("POST", "/api/v1/namespaces/ns/pods")] * 3
        assert all(h["authorization"] == "Bearer from-a-file" for _, _, h, _ in srv.seen)
        assert srv.seen[0][2]["user-agent"].startswith("trainingrun-operator/") and api.requests == 3
        api.close()
    # errors: 409 on create is "exists"; 422 raises with the server's message; 404 on delete is "was not there"
    script = [(409, {}, status(409, "AlreadyExists", "exists"))]
    with server(script) as srv:
        api = kube.KubeApi(kube.load_configuration(kubeconfig(tmp_path, url_of(srv), {"token": "t"})))
        assert asyncio.run(api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})) is False
        srv.script = [(422, {}, status(422, "Invalid", 'Pod "p" is invalid: spec.containers: Required value'))]
        with pytest.raises(kube.ApiError) as err:
            asyncio.run(api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}))
        assert err.value.status == 422 and "spec.containers: Required value" in err.value.detail
        srv.script = [(404, {}, status(404, "NotFound", "gone"))]
        assert asyncio.run(api.delete("v1", "Pod", "ns", "p")) is False
        srv.script = [(409, {}, status(409, "Conflict", "the object has been modified"))]
        with pytest.raises(kube.Conflict):
            asyncio.run(api.patch("trainingrun.dev/v1alpha1", "TrainingRun", "ns", "r", {"status": {}},
                                  subresource="status"))
        method, path, headers, body = srv.seen[-1]
        assert (method, path) == ("PATCH", "/apis/trainingrun.dev/v1alpha1/namespaces/ns/trainingruns/r/status")
        assert headers["content-type"] == "application/merge-patch+json" and json.loads(body) == {"status": {}}
        api.close()


def test_calls_run_in_a_bounded_pool_off_the_event_loop(tmp_path):
    with server([(200, {}, {"kind": "Pod"})], delay=0.3) as srv:
        api = kube.KubeApi(kube.load_configuration(kubeconfig(tmp_path, url_of(srv), {"token": "t"})), workers=2)

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            tick = asyncio.create_task(ticker())
            await asyncio.gather(*(api.get("/api/v1/namespaces/ns/pods/p") for _ in range(6)))
            tick.cancel()
            return ticks

        t0 = time.monotonic()
        ticks = asyncio.run(main())
        elapsed = time.monotonic() - t0
        api.close()
    assert srv.peak == 2  # at most `workers` requests in flight
    assert elapsed >= 0.9  # 6 requests of 0.3 s, 2 at a time
    assert ticks > 30  # the event loop kept running meanwhile


def test_in_cluster_service_account_and_proxy(tmp_path, monkeypatch):
    import kubernetes.config.incluster_config as incluster

    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("service-account-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(ca))
    cfg = kube.load_configuration()
    info = kube.connection_info(cfg)
    assert info.server == "https://10.0.0.1:443" and info.token == "service-account-token" and info.ca_path == str(ca)
    # $KUBECONFIG wins over the service account; its proxy-url carries our calls and kopf's
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with server([(200, {}, {"kind": "Pod", "metadata": {"name": "via-proxy"}})]) as proxy:
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": "http://cluster.invalid:6443",
                                                   "proxy-url": url_of(proxy)}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(path))
        cfg = kube.load_configuration()
        assert kube.connection_info(cfg).proxy_url == url_of(proxy)
        api = kube.KubeApi(cfg)
        got = asyncio.run(api.get("/api/v1/namespaces/ns/pods/via-proxy"))
        api.close()
    assert got["metadata"]["name"] == "via-proxy"
    # a forward proxy is asked for the absolute URL of the API server
    assert proxy.seen[0][1] == "http://cluster.invalid:6443/api/v1/namespaces/ns/pods/via-proxy"


def test_unreachable_server_is_an_api_error_with_status_0(tmp_path):
    cfg = kube.load_configuration(kubeconfig(tmp_path, "http://127.0.0.1:9", {"token": "t"}))
    api = kube.KubeApi(cfg, retries=1, timeout=2)
    with pytest.raises(kube.ApiError) as err:
        asyncio.run(api.get("/api/v1"))
    api.close()
    assert err.value.status == 0 and "no answer" in str(err.value)
