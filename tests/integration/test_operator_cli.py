"""`trainingrun operator` as a process (what the chart runs) against the KMock emulator: logging in through the
official `kubernetes` client's configuration (an exec credential plugin and client certificate data here), its
metrics endpoint, and no temporary key files left behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.kube import Cluster
from tests.services import stop_process, wait_for

# An exec credential plugin (what cloud logins use): a token, or a client certificate and key (PLUGIN_CERT, PEM).
EXEC_PLUGIN = """import json, os
cert = os.environ.get("PLUGIN_CERT")
status = ({"clientCertificateData": open(cert).read(), "clientKeyData": open(os.environ["PLUGIN_KEY"]).read()}
          if cert else {"token": "token-from-exec-plugin"})
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}))
"""


def write_kubeconfig(path: Path, server: str, plugin: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "plugin", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable, "args": [str(plugin)],
            "interactiveMode": "Never"}}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "plugin"}}],
    }))
    return path


def test_operator_process_logs_in_through_an_exec_plugin(tmp_path, redis):
    """kopf's watches and the operator's own calls both carry the plugin's token; progress and metrics flow."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(EXEC_PLUGIN)
    with Cluster() as c:
        log = tmp_path / "operator.log"
        proc = c.start_operator("--api-workers", "4", kubeconfig=write_kubeconfig(tmp_path / "kc", c.url, plugin),
                                log=log)
        try:
            c.new_run("cli", store={"url": redis.url})
            c.run_all("cli", 0)
            assert c.emulator.authorization["kopf"] == {"Bearer token-from-exec-plugin"}
            assert c.emulator.authorization["trainingrun-operator"] == {"Bearer token-from-exec-plugin"}
            # progress from the store reaches the status; the metrics endpoint serves the per-run series
            from trainingrun.store import open_store

            trainer = c.pods("cli", role="trainer")[0]
            env = {e["name"]: e["value"] for e in trainer["spec"]["containers"][0]["env"]}
            store = open_store(env["TRAININGRUN_STORE_URL"])
            store.put_json("progress", {"step": 5, "samples_consumed": 50, "last_global_batch_size": 10,
                                        "rollout": 1, "attempt": 0, "time": time.time()})
            wait_for(lambda: c.status("cli").get("step") == 5, 15, "progress in the status")
            store.close()

            def step_gauge():
                text = urllib.request.urlopen(c.metrics_url, timeout=5).read().decode()
                return next((s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                             if s.name == "trainingrun_operator_run_step" and s.labels.get("run") == "cli"), None)

            wait_for(lambda: step_gauge() == 5, 15, "the per-run step gauge")
        finally:
            stop_process(proc)
            print(log.read_text()[-3000:])
        assert proc.returncode == 0


def test_no_key_files_are_left_behind(tmp_path):
    """A plugin that answers with a client certificate: the client keeps it in temporary files while the operator
    runs (urllib3 and aiohttp load certificates from files) and removes them when it stops."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (needed to make a client certificate)")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=operator",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")], check=True,
                   capture_output=True)
    plugin = tmp_path / "plugin.py"
    plugin.write_text(EXEC_PLUGIN)
    scratch = tmp_path / "tmp"  # the operator's TMPDIR
    scratch.mkdir()
    with Cluster() as c:
        env = {"TMPDIR": str(scratch), "PLUGIN_CERT": str(tmp_path / "cert.pem"), "PLUGIN_KEY": str(tmp_path / "key.pem")}
        proc = c.start_operator(kubeconfig=write_kubeconfig(tmp_path / "kc", c.url, plugin), env=env)
        try:
            held = sorted(p.read_text()[:27] for p in scratch.iterdir())
            assert held == ["-----BEGIN CERTIFICATE-----", "-----BEGIN PRIVATE KEY-----"], held
        finally:
            stop_process(proc)
    assert proc.returncode == 0 and list(scratch.iterdir()) == []


def test_operator_refuses_bad_arguments():
    for args, field in ((["--api-workers", "0"], "--api-workers"), (["--interval", "0"], "--interval")):
        out = subprocess.run([sys.executable, "-m", "trainingrun", "operator", *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and field in out.stderr, out.stderr
