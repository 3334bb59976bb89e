"""The local launcher's supervision, with small real stand-in child processes (fast; no Megatron).

The launcher runs as a real subprocess (`python -m trainingrun run ...`); TRAININGRUN_CHILD_COMMAND makes it start
the stand-in below instead of `python -m trainingrun rollout|trainer`. The stand-in behaves like the real programs
where the launcher can tell: rank 0 appends one JSON object per step to $TRAININGRUN_METRICS_JSONL, trainers resume
from a checkpoint file in the run directory, and failure modes (exit code, signal, hang) are chosen by FAKE_MODE.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.services import pid_alive, wait_for
from trainingrun.local.procs import ephemeral_port_range

ROOT = Path(__file__).resolve().parents[2]

FAKE_CHILD = r'''
import json, os, signal, subprocess, sys, time
role = sys.argv[1]
mode = os.environ.get("FAKE_MODE", "ok")
attempt = int(os.environ["TRAININGRUN_ATTEMPT"])
for key in ("TRAININGRUN_RUN", "TRAININGRUN_STORE_URL", "TRAININGRUN_CONFIG", "TRAININGRUN_METRICS_PORT"):
    assert os.environ.get(key), key
import hashlib  # the launcher names the exact bytes it checked: the children skip those checks (api/manifest.py)
assert hashlib.sha256(open(os.environ["TRAININGRUN_CONFIG"], "rb").read()).hexdigest() == \
    os.environ["TRAININGRUN_CONFIG_SHA256"]
print(f"fake {role} attempt {attempt} starting in {os.getcwd()}", flush=True)
print(f"fake OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
if mode == "sleep":
    if os.environ.get("RANK") == "1":
        # a grandchild in the same process group, and a process that ignores SIGTERM
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open("grandchild.pid", "w").write(str(g.pid))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
if role == "rollout":
    generation = int(os.environ.get("TRAININGRUN_ROLE_ATTEMPT", "0"))
    print(f"fake rollout generation {generation}", flush=True)
    time.sleep(0.2)
    if mode == "rollout-always" or (mode == "rollout-once" and attempt == 0 and generation == 0):
        print("fake failure marker: the rollout gives up", flush=True)
        sys.exit(2)
    sys.exit(0)
rank = int(os.environ["RANK"])
assert int(os.environ["WORLD_SIZE"]) >= 1 and os.environ["MASTER_ADDR"] == "127.0.0.1"
if mode == "config" and rank == 0:
    print("config error: spec.trainer.something is wrong", flush=True)
    sys.exit(78)
if mode == "config-slow-peer":  # every rank meets the error; rank 1 reaches its line a second later
    time.sleep(1.5 if rank == 1 else 0)
    print(f"config error seen by rank {rank}", flush=True)
    sys.exit(78)
steps = int(os.environ.get("FAKE_STEPS", "12"))
ckpt = "fake-ckpt.json"
start = json.load(open(ckpt))["next_step"] if os.path.exists(ckpt) else 0
samples = sum(4 + s % 3 for s in range(start))
for step in range(start, steps):
    time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0.05")))
    if mode == "hang" and step == 2:
        time.sleep(600)
    if rank == 1 and ((mode == "always" and step == start + 1) or (mode == "once" and attempt == 0 and step == 5)):
        print("fake failure marker: rank 1 gives up", flush=True)
        sys.exit(3)
    gbs = 4 + step % 3
    samples += gbs
    if rank == 0:
        rec = dict(step=step, rollout=step // 4, global_batch_size=gbs, num_microbatches=1, loss=1.0 / (step + 1),
                   lr=1e-3, grad_norm=1.0, samples_consumed=samples, tokens=10 * gbs, attempt=attempt)
        with open(os.environ["TRAININGRUN_METRICS_JSONL"], "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        if (step + 1) % 3 == 0:
            json.dump({"next_step": step + 1}, open(ckpt + ".tmp", "w"))
            os.replace(ckpt + ".tmp", ckpt)
print("fake done", flush=True)
'''


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    return script


def make_spec(tmp_path: Path, **failure_policy) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["rollout"]["numRollouts"] = 3
    doc["spec"]["failurePolicy"] = {"maxRestarts": 2, "backoffSeconds": 0, **failure_policy}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def launch(spec: Path, out: Path, fake: Path, *extra: str, mode: str = "ok", plot: bool = False,
           **env) -> subprocess.Popen:
    """The real launcher over fake children; without `plot`, `--no-plot` (matplotlib's 2 s per launch)."""
    full_env = {**os.environ, "TRAININGRUN_CHILD_COMMAND": shlex.join([sys.executable, str(fake)]),
                "FAKE_MODE": mode, **env}
    return subprocess.Popen(
        [sys.executable, "-m", "trainingrun", "run", str(spec), "--out", str(out), "--grace-seconds", "1",
         "--progress-interval", "0.2", *([] if plot else ["--no-plot"]), *extra],
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def expected_samples(steps: int) -> int:
    return sum(4 + s % 3 for s in range(steps))


def test_successful_run_writes_outputs(tmp_path, fake):
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(make_spec(tmp_path), out, fake, "--trainers", "3"))
    assert code == 0, stderr
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(12))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["steps"] == 12 and summary["restarts"] == 0
    assert summary["samples_consumed"] == expected_samples(12)
    assert summary["first_loss"] == 1.0 and summary["final_loss"] == pytest.approx(1 / 12)
    assert (summary["global_batch_size_min"], summary["global_batch_size_max"]) == (4, 6)
    assert set(summary["exit_codes"]) == {"rollout", "trainer-0", "trainer-1", "trainer-2"}
    assert all(summary["exit_codes"][f"trainer-{r}"] == 0 for r in range(3))
    # --trainers overrides the spec's replicas in the effective spec every process reads
    assert yaml.safe_load((out / "run.yaml").read_text())["spec"]["trainer"]["replicas"] == 3
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["launcher.log", "rollout.log", "trainer-0.log",
                                                                "trainer-1.log", "trainer-2.log"]
    assert "fake done" in (out / "logs" / "trainer-2.log").read_text()
    pids = json.loads((out / "pids.json").read_text())
    ports = [p["metrics_port"] for p in pids["processes"].values()]
    assert len(set(ports)) == 4 and max(ports) - min(ports) == 3
    # the trainers' rendezvous port lies below the ephemeral range: no bind(0) can take it before rank 0 binds it
    assert 1024 <= pids["master_port"] < ephemeral_port_range()[0]
    assert "status" in stdout and "succeeded" in stdout  # the summary table
    assert "step 11" in stdout  # a plain progress line reached the last step


def test_failed_rank_restarts_group_and_resumes(tmp_path, fake):
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(make_spec(tmp_path), out, fake, mode="once"))
    assert code == 0, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["status"] == "succeeded"
    first = summary["attempts"][0]
    assert first["culprit"] == "trainer-1" and first["exit_codes"]["trainer-1"] == 3
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(12))  # exactly one record per step
    # attempt 0's records form a prefix, the resumed attempt 1 trained the rest from the checkpoint
    attempts = [r["attempt"] for r in recs]
    assert attempts == sorted(attempts) and attempts[0] == 0 and attempts[-1] == 1
    raw0 = [json.loads(x)["step"] for x in (out / "raw" / "trainer-metrics.attempt0.jsonl").read_text().splitlines()]
    raw1 = [json.loads(x)["step"] for x in (out / "raw" / "trainer-metrics.attempt1.jsonl").read_text().splitlines()]
    assert raw1[0] % 3 == 0 and raw1[0] <= raw0[-1] + 1 and raw1[-1] == 11  # resumed at a checkpoint boundary
    assert recs[-1]["samples_consumed"] == expected_samples(12)
    assert (out / "logs" / "trainer-1.attempt1.log").exists()
    assert "restarting the group" in stdout


def test_restarts_exhausted_names_failing_process(tmp_path, fake):
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(make_spec(tmp_path, maxRestarts=1), out, fake, mode="always"))
    assert code == 1
    assert "trainer-1" in stderr and "exit 3" in stderr
    assert "fake failure marker" in stderr  # the log tail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["restarts"] == 1 and len(summary["attempts"]) == 2
    assert summary["failure"]["process"] == "trainer-1"


def test_config_error_is_not_restarted(tmp_path, fake):
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(make_spec(tmp_path, maxRestarts=3), out, fake, mode="config"))
    assert code == 78
    assert "trainer-0" in stderr and "config error" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1
    assert not list((out / "logs").glob("*.attempt1.log"))


def test_the_peers_of_a_rank_that_exits_78_say_so_themselves_before_the_group_stops(tmp_path, fake):
    """A configuration error (or a full volume) one rank reports, its peers meet too: the launcher lets them exit
    on their own (up to PEER_EXIT_SECONDS) instead of SIGTERMing them at once. Regression: under load, rank 0 of a
    full-volume run was cut off before its own line (CI, test_reliability_e2e)."""
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(make_spec(tmp_path), out, fake, mode="config-slow-peer"))
    assert code == 78, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_codes"]["trainer-0"] == 78 and summary["exit_codes"]["trainer-1"] == 78, summary
    assert "config error seen by rank 1" in (out / "logs" / "trainer-1.log").read_text()


def test_progress_deadline_counts_as_failure(tmp_path, fake):
    out = tmp_path / "run"
    spec = make_spec(tmp_path, maxRestarts=0, progressDeadlineSeconds=2)
    t0 = time.monotonic()
    code, stdout, stderr = finish(launch(spec, out, fake, mode="hang"))
    assert code == 1 and "progress deadline" in stderr
    assert time.monotonic() - t0 < 20
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2  # steps 0 and 1 were trained before the hang


def test_sigint_stops_every_child_and_grandchild(tmp_path, fake):
    out = tmp_path / "run"
    proc = launch(make_spec(tmp_path), out, fake, mode="sleep")
    try:
        pids = wait_for(lambda: json.loads((out / "pids.json").read_text()), 20, "pids.json")
        grandchild = int(wait_for(lambda: (out / "grandchild.pid").read_text(), 20, "grandchild pid"))
        children = [p["pid"] for p in pids["processes"].values()]
        assert all(pid_alive(p) for p in [*children, grandchild])
        proc.send_signal(signal.SIGINT)
        code, stdout, stderr = finish(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    # trainer-1 ignores SIGTERM: the launcher escalated to SIGKILL after the grace period; nothing is left
    wait_for(lambda: not any(pid_alive(p) for p in [*children, grandchild]), 5, "children gone")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["exit_codes"]["trainer-1"] == -signal.SIGKILL


def test_stop_and_rerun_resumes_in_same_directory(tmp_path, fake):
    out = tmp_path / "run"
    spec = make_spec(tmp_path)
    proc = launch(spec, out, fake, FAKE_STEP_SECONDS="0.15")
    try:
        wait_for(lambda: (out / "fake-ckpt.json").exists(), 30, "first checkpoint")
        proc.send_signal(signal.SIGTERM)
        code, _, _ = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143
    partial = read_metrics(out)
    assert 3 <= len(partial) < 12
    code, stdout, stderr = finish(launch(spec, out, fake))
    assert code == 0, stderr
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(12))
    assert recs[-1]["samples_consumed"] == expected_samples(12)
    assert (out / "logs" / "trainer-0.attempt1.log").exists()  # attempts continue across invocations
    assert json.loads((out / "summary.json").read_text())["first_attempt"] == 1


def test_bad_spec_exits_1_naming_the_field_and_starts_nothing(tmp_path, fake):
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["rollout"]["samplesPerRollout"] = -5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    code, _, stderr = finish(launch(bad, out, fake))
    assert code == 1 and "samplesPerRollout" in stderr
    assert not out.exists()
    code, _, stderr = finish(launch(make_spec(tmp_path), out, fake, "--trainers", "0"))
    assert code == 1 and "spec.trainer.replicas: invalid value 0" in stderr and "minimum of 1" in stderr
    assert not out.exists()


def test_rerun_of_a_finished_run_does_nothing(tmp_path, fake):
    out = tmp_path / "run"
    spec = make_spec(tmp_path)
    assert finish(launch(spec, out, fake))[0] == 0
    before = (out / "summary.json").read_text()
    code, stdout, stderr = finish(launch(spec, out, fake))
    assert code == 0 and "already succeeded" in stderr and "succeeded" in stdout
    assert (out / "summary.json").read_text() == before and not list((out / "logs").glob("*.attempt1.log"))


@pytest.mark.parametrize("user_value", [None, "3"])
def test_children_get_one_openmp_thread_unless_the_user_says_otherwise(tmp_path, fake, user_value):
    """N processes on a few cores with torch's default thread count ran a tiny model ~100x slower (tooling notes);
    the launcher gives every child OMP_NUM_THREADS=1 unless the user set it (regression: it set nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_value is not None:
        env["OMP_NUM_THREADS"] = user_value
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainingrun", "run", str(make_spec(tmp_path)), "--out", str(out), "--grace-seconds",
         "1", "--progress-interval", "0.2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "TRAININGRUN_CHILD_COMMAND": shlex.join([sys.executable, str(fake)]), "FAKE_MODE": "ok"})
    code, _, stderr = finish(proc)
    assert code == 0, stderr
    for name in ("rollout", "trainer-0", "trainer-1"):
        assert f"fake OMP_NUM_THREADS={user_value or 1}" in (out / "logs" / f"{name}.log").read_text(), name


def test_failed_rollout_restarts_alone_while_the_trainers_run_on(tmp_path, fake):
    """The default rule for the rollout: it restarts alone (same attempt, its next generation in
    TRAININGRUN_ROLE_ATTEMPT, after the rollout role's backoff), the trainers are never touched, pids.json names the
    new rollout, and the restart counts against failurePolicy.roles.rollout, not maxRestarts (0 here)."""
    out = tmp_path / "run"
    spec = make_spec(tmp_path, maxRestarts=0, roles={"rollout": {"maxRestarts": 1, "backoffSeconds": 0}})
    proc = launch(spec, out, fake, mode="rollout-once", FAKE_STEP_SECONDS="0.15")
    first = wait_for(lambda: json.loads((out / "pids.json").read_text()) if (out / "pids.json").exists() else None,
                     30, "pids.json")
    code, stdout, stderr = finish(proc)
    assert code == 0, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "succeeded" and len(summary["attempts"]) == 1
    assert summary["restarts"] == 1 and summary["role_restarts"] == {"rollout": 1}
    (event,) = summary["attempts"][0]["role_restarts"]
    assert event["process"] == "rollout" and event["generation"] == 1 and event["counted"]
    pids = summary["attempts"][0]["pids"]
    trainers = {n: p for n, p in first["processes"].items() if n != "rollout"}
    assert {n: pids[n] for n in trainers} == {n: p["pid"] for n, p in trainers.items()}  # never restarted
    assert pids["rollout"] != first["processes"]["rollout"]["pid"]
    assert json.loads((out / "pids.json").read_text())["processes"]["rollout"]["pid"] == pids["rollout"]
    log = (out / "logs" / "rollout.log").read_text()
    assert "fake rollout generation 0" in log and "fake rollout generation 1" in log and "restarted alone" in log
    assert [r["step"] for r in read_metrics(out)] == list(range(12))  # one attempt, every step once
    assert "restarting the rollout alone" in stdout and not list((out / "logs").glob("*.attempt1.log"))


def test_rollout_budget_and_a_rule_that_restarts_the_group(tmp_path, fake):
    """A rollout that keeps failing spends failurePolicy.roles.rollout and the run fails naming that budget; a rule
    sends a rollout failure to the whole group instead (counted against maxRestarts)."""
    out = tmp_path / "spent"
    spec = make_spec(tmp_path, maxRestarts=3, roles={"rollout": {"maxRestarts": 1, "backoffSeconds": 0}})
    code, stdout, stderr = finish(launch(spec, out, fake, mode="rollout-always", FAKE_STEP_SECONDS="0.3"))
    assert code == 1 and "rollout" in stderr and "exit 2" in stderr, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["role_restarts"] == {"rollout": 1} and len(summary["attempts"]) == 1
    assert "failurePolicy.roles.rollout.maxRestarts" in stdout
    out = tmp_path / "group"
    spec = make_spec(tmp_path, maxRestarts=2, rules=[{"roles": ["rollout"], "exitCodes": [2], "action": "RestartGroup"}])
    code, stdout, stderr = finish(launch(spec, out, fake, mode="rollout-once", FAKE_STEP_SECONDS="0.15"))
    assert code == 0, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["role_restarts"] == {} and len(summary["attempts"]) == 2
    assert summary["attempts"][0]["culprit"] == "rollout" and "restarting the group" in stdout


# a stand-in vLLM server's start: its port from vLLM's command line, and /health (started by `serve()`)
FAKE_VLLM_HEALTH = r'''
import http.server, os, sys, threading, time
args = sys.argv[1:]
port, model = int(args[args.index("--port") + 1]), args[args.index("--model") + 1]


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


def serve():
    threading.Thread(target=http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever,
                     daemon=True).start()
'''

FAKE_VLLM = FAKE_VLLM_HEALTH + r'''
starts = os.path.join(model, "starts")
n = int(open(starts).read()) if os.path.exists(starts) else 0
open(starts, "w").write(str(n + 1))
print(f"fake vllm start {n}", flush=True)
serve()
time.sleep(1.0)
if n == 0:
    print("fake vllm dies", flush=True)
    os._exit(3)
time.sleep(600)
'''


def vllm_run(tmp_path: Path, fake_vllm: str, failure_policy: dict) -> tuple[Path, Path]:
    """A spec whose run owns one vLLM server, and the stand-in `fake_vllm` (a script that gets vLLM's command line)
    as that server's Python ($TRAININGRUN_VLLM_PYTHON): (spec path, stand-in path)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}))
    engine = tmp_path / "fake-vllm"
    engine.write_text(f"#!{sys.executable}\n{fake_vllm}")
    engine.chmod(0o755)
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    spec = doc["spec"]
    spec["model"] = {"hf": str(model), "seqLength": 64}
    spec["trainer"] = {**spec["trainer"], "lossType": "ppo"}
    spec["rollout"] = {**spec["rollout"], "numRollouts": 3, "source": {"type": "generate", "generate": {
        "prompts": {"type": "synthetic", "synthetic": {"task": "copy", "minLength": 2, "maxLength": 2}},
        "sampling": {"maxNewTokens": 4}, "reward": {"type": "function", "function": "m:f"}}},
        "engine": {"type": "vllm", "vllm": {"maxModelLen": 64}}}
    spec["weightSync"] = {"type": "disk"}
    spec["failurePolicy"] = failure_policy
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, engine


def test_the_runs_vllm_server_restarts_alone_on_the_engine_budget(tmp_path, fake):
    """The run's own vLLM server (a stand-in serving /health) dies once: the default rule restarts that engine
    replica alone on failurePolicy.roles.engine (maxRestarts 0 for the group), the rollout and trainers run on."""
    path, engine = vllm_run(tmp_path, FAKE_VLLM, {"maxRestarts": 0, "backoffSeconds": 0,
                                                  "roles": {"engine": {"maxRestarts": 1}}})
    out = tmp_path / "run"
    proc = launch(path, out, fake, FAKE_STEP_SECONDS="0.4", TRAININGRUN_VLLM_PYTHON=str(engine))
    first = wait_for(lambda: json.loads((out / "pids.json").read_text()) if (out / "pids.json").exists() else None,
                     60, "pids.json")
    code, stdout, stderr = finish(proc)
    assert code == 0, stderr + stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "succeeded" and len(summary["attempts"]) == 1
    assert summary["role_restarts"] == {"engine": 1} and summary["restarts"] == 1
    assert first["processes"]["engine-0"]["role"] == "engine"  # the pool's servers are listed as engine-<i>
    assert summary["attempts"][0]["pids"] == {n: p["pid"] for n, p in first["processes"].items()
                                              if p["role"] != "engine"}  # none of the attempt's touched
    assert (tmp_path / "model" / "starts").read_text() == "2" and "restarting the engine" in stdout
    assert "engine replica 0" in stdout and "failurePolicy.roles.engine" in stdout
