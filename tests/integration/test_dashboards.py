"""The Grafana dashboards shipped in the chart.

Static checks (fast): generated JSON in sync with generate.py, schemaVersion >= 39, the datasource/namespace/run
variables, every query on a known metric name, weighted metrics as Σrate(X_sum)/Σrate(X_count).

Acceptance (marked `megatron`, ~1-2 min): every panel query, evaluated by a real Prometheus, returns data —
  * run-level panels (all of "run detail", the "Runs" row of "overview") against a real local run
    (`trainingrun run`, a shortened examples/rl.yaml with every policy option that has a panel on — pi_old from the
    trainer, a rollout correction, sequence ratios, an entropy bonus: real rollout generating with the in-process
    engine + 2 real Megatron-core trainers at tensor parallelism 2 on CPU);
  * operator panels ("Operator" row of "overview") against the real operator (`trainingrun operator`, kopf)
    reconciling a TrainingRun of the same name in the KMock API emulator of tests/kube.py — the operator's metrics
    (including the per-run series filtered by $namespace/$run) come from a real operator process, not from the local
    run, which has no operator.
Queries are run as Grafana runs them over the run's time span, with $namespace = All (.*), $run = the run's name,
and step and $__rate_interval as Grafana computes them: on a range this short the step is the datasource's scrape
interval (its floor), and $__rate_interval = max(step + scrape interval, 4 × scrape interval). Prometheus scrapes every
100 ms: the local run is short (its rollout process lives one to three seconds), and with 1 s scrapes a rate() panel of
the rollout could find fewer than the two samples it needs in any window (seen in CI).
"""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
import yaml

from trainingrun.metrics import names
from trainingrun.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "charts" / "trainingrun" / "dashboards"))
from generate import DCGM_SEL  # noqa: E402 - the generator is a script beside the dashboards

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "trainingrun" / "dashboards"
SCRAPE_INTERVAL_MS = 100
QUERY_STEP_MS = SCRAPE_INTERVAL_MS  # Grafana: range / max data points, floored at the scrape interval
RATE_INTERVAL = f"{max(QUERY_STEP_MS + SCRAPE_INTERVAL_MS, 4 * SCRAPE_INTERVAL_MS)}ms"  # Grafana's rule
RUN_NAME = "dash"
NUM_ROLLOUTS = 6
RUN_TIMEOUT = 300

ALL_METRICS = {**names.TRAINER_WEIGHTED, **names.TRAINER_GAUGES, **names.TRAINER_COUNTERS, **names.ROLLOUT,
               **names.ROLLOUT_WEIGHTED, **names.EVAL, **names.OPERATOR}


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def targets(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, and of every Prometheus annotation."""
    exprs = [(p["title"], t["expr"]) for p in all_panels(dashboard) for t in p.get("targets", [])]
    exprs += [(f"annotation {a['name']}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def is_dcgm(expr: str) -> bool:
    return "DCGM_FI_" in expr


def is_operator_panel(expr: str) -> bool:
    return "trainingrun_operator_" in expr


# The operator's own health (no namespace/run labels); every other metric is per run and must follow the pickers.
OPERATOR_WIDE = {"trainingrun_operator_reconcile_seconds", "trainingrun_operator_runs", "trainingrun_operator_restarts",
                 "trainingrun_operator_errors"}


def substitute(expr: str, run: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", ".*").replace("$run", run))


def base_metric(series_name: str) -> str:
    """The names.py name behind an exposed series name (X_sum/X_count/X_bucket of summaries/histograms, _total)."""
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if series_name.endswith(suffix) and series_name[: -len(suffix)] in ALL_METRICS:
            return series_name[: -len(suffix)]
    return series_name


# ------------------------------------------------------------------------------------------------- static checks
def test_dashboards_json_is_generated_and_in_sync():
    proc = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert set(dashboards()) == {"overview.json", "run.json"}


@pytest.mark.parametrize("name", ["overview.json", "run.json"])
def test_dashboard_structure(name):
    d = dashboards()[name]
    assert d["schemaVersion"] >= 39 and d["uid"].startswith("trainingrun-")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["type"] == "query" and variables["namespace"]["includeAll"]
    assert variables["namespace"]["allValue"] == ".*"
    run = variables["run"]
    assert run["type"] == "query" and "$namespace" in run["definition"]
    if name == "run.json":  # one run: no "All" that would mix runs in the per-step panels
        assert not run["includeAll"] and not run["multi"] and "allValue" not in run and run["current"] == {}
    else:
        assert run["includeAll"] and run["multi"] and run["allValue"] == ".*"
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids))
    for p in all_panels(d):
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


@pytest.mark.parametrize("name", ["overview.json", "run.json"])
def test_every_query_uses_known_metrics_and_the_variables(name):
    for title, expr in targets(dashboards()[name]):
        if is_dcgm(expr):  # dcgm-exporter's GPU metrics, selected by the run's pod names
            for s in re.findall(r"\b(DCGM_FI_[A-Z_]+)\b", expr):
                assert re.search(rf'{s}\{{namespace=~"\$namespace", pod=~"\$run-\(trainer\|rollout\)-\.\+"\}}', expr), expr
            continue
        series = set(re.findall(r"\b(trainingrun_[a-z0-9_]+)\b", expr))
        assert series, f"{title}: no trainingrun metric in {expr}"
        for s in series:
            assert base_metric(s) in ALL_METRICS, f"{title}: {s} is not in trainingrun.metrics.names"
        for s in series:
            if base_metric(s) not in OPERATOR_WIDE:  # run-level series follow the namespace and run pickers
                assert re.search(rf'{s}\{{[^}}]*namespace=~"\$namespace", run=~"\$run"', expr), f"{title}: {expr}"
        assert "[5m]" not in expr and ("rate(" not in expr or "[$__rate_interval]" in expr), expr


def test_run_dashboard_covers_the_issue_panels():
    exprs = " ".join(e for _, e in targets(dashboards()["run.json"]))
    w = "trainingrun_trainer_sample_loss"
    sel = r'\{namespace=~"\$namespace", run=~"\$run"\}'
    assert re.search(rf"sum\(rate\({w}_sum{sel}\[\$__rate_interval\]\)\) / sum\(rate\({w}_count{sel}"
                     r"\[\$__rate_interval\]\)\)", exprs), "weighted loss must be Σrate(_sum)/Σrate(_count)"
    for metric in ("trainingrun_trainer_global_batch_size", "trainingrun_trainer_samples_per_second",
                   "trainingrun_trainer_tokens_per_second", "trainingrun_trainer_lr", "trainingrun_trainer_grad_norm",
                   "trainingrun_trainer_step_seconds", "trainingrun_rollout_schedule_imbalance",
                   "trainingrun_trainer_rank_tokens_total"):
        assert metric in exprs, metric
    assert "sum by (rank) (rate(trainingrun_trainer_rank_tokens_total" in exprs  # per-rank throughput
    # the Policy row (generated rollouts): weighted means over all ranks, and rank 0's largest correction weight
    for name in ("mismatch_kl", "logprob_abs_diff", "correction_weight", "masked_fraction", "importance_ratio",
                 "clip_fraction", "dual_clip_fraction", "seq_clip_fraction", "entropy", "entropy_bonus"):
        assert f"sum(rate(trainingrun_trainer_{name}_sum" in exprs, name
    assert "max(trainingrun_trainer_correction_weight_max{" in exprs
    # the engine pool (issue 30): prefix-cache hit rate and requests in flight per engine
    assert "sum by (engine) (rate(trainingrun_rollout_engine_prefix_cache_hits_total{" in exprs
    assert "sum by (engine) (rate(trainingrun_rollout_engine_prefix_cache_queries_total{" in exprs
    assert "max by (engine) (trainingrun_rollout_engine_inflight{" in exprs
    assert "max by (engine) (trainingrun_rollout_engine_concurrency{" in exprs
    overview = " ".join(e for _, e in targets(dashboards()["overview.json"]))
    for metric in ("trainingrun_operator_reconcile_seconds_bucket", "trainingrun_operator_errors_total"):
        assert metric in overview, metric
    sel = r'\{namespace=~"\$namespace", run=~"\$run"\}'
    assert re.search(rf"sum by \(phase\) \(max by \(namespace, run, phase\) \(trainingrun_operator_run_phase{sel}\)\)",
                     overview), "runs by phase from the per-run gauge, filtered by namespace and run"
    assert re.search(rf"max by \(namespace, run\) \(trainingrun_operator_run_restarts{sel}\)", overview)


def test_per_step_panels_plot_against_the_step_and_throughput_has_two_axes():
    run = {p["title"]: p for p in all_panels(dashboards()["run.json"])}
    per_step = {"Loss per step": "step", "Global batch size per step": "step", "Micro-batches per rank": "step",
                "Step time": "step", "Gradient norm per step": "step",
                "Learning rate vs samples consumed": "samples consumed"}
    x_metric = {"step": "trainingrun_trainer_step", "samples consumed": "trainingrun_trainer_samples_consumed"}
    for title, x in per_step.items():
        p = run[title]
        assert p["type"] == "trend" and p["options"]["xField"] == x, title
        assert p["fieldConfig"]["defaults"]["custom"]["drawStyle"] in ("points", "bars")
        assert p["fieldConfig"]["defaults"]["custom"]["showPoints"] == "always"
        x_targets = [t for t in p["targets"] if t["legendFormat"] == x]
        assert len(x_targets) == 1 and x_metric[x] in x_targets[0]["expr"]
        assert p["transformations"][0] == {"id": "joinByField", "options": {"byField": "Time", "mode": "inner"}}
    assert run["Global batch size per step"]["fieldConfig"]["defaults"]["custom"]["drawStyle"] == "bars"
    tp = run["Samples and tokens per second"]
    (override,) = tp["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byName", "options": "tokens/s"}
    assert {"id": "custom.axisPlacement", "value": "right"} in override["properties"]
    assert [t["legendFormat"] for t in tp["targets"]] == ["samples/s", "tokens/s"]


def test_run_dashboard_has_an_evaluation_row():
    run = {p["title"]: p for p in all_panels(dashboards()["run.json"])}
    assert run["Evaluation (held-out prompts)"]["type"] == "row"
    trend = run["Held-out reward and pass@k"]
    assert trend["type"] == "trend" and trend["options"]["xField"] == "step"
    exprs = {t["legendFormat"]: t["expr"] for t in trend["targets"]}
    assert "trainingrun_eval_step" in exprs["step"] and "trainingrun_eval_pass_at_k" in exprs["pass@k"]
    assert "trainingrun_eval_reward_mean" in exprs["reward mean"] and "trainingrun_eval_pass_at_1" in exprs["pass@1"]


def test_run_table_restart_annotations_and_gpu_rows():
    overview = {p["title"]: p for p in all_panels(dashboards()["overview.json"])}
    table = overview["TrainingRuns"]
    assert table["type"] == "table" and all(t["format"] == "table" and t["instant"] for t in table["targets"])
    rename = table["transformations"][1]["options"]["renameByName"]
    assert list(rename.values()) == ["NAMESPACE", "NAME", "PHASE", "STEP", "GBS", "SAMPLES", "RESTARTS", "PROGRESS",
                                     "ETA"]
    for d in dashboards().values():
        (restarts,) = [a for a in d["annotations"]["list"] if a.get("name") == "Restarts"]
        assert "trainingrun_operator_run_restarts" in restarts["expr"] and restarts["enable"]
        (gpu,) = [p for p in d["panels"] if p["title"].startswith("GPU")]
        assert gpu["type"] == "row" and gpu["collapsed"]
        exprs = " ".join(t["expr"] for p in gpu["panels"] for t in p["targets"])
        assert "DCGM_FI_DEV_GPU_UTIL" in exprs and "DCGM_FI_DEV_FB_USED" in exprs


# --------------------------------------------------------------------------------------------------- acceptance
def query_range(url: str, promql: str, start: float, end: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                "step": f"{QUERY_STEP_MS / 1000:g}"})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{q}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]


def finite_points(result: list[dict]) -> int:
    return sum(1 for s in result for _, v in s["values"] if math.isfinite(float(v)))


def check_panels(url: str, exprs: list[tuple[str, str]], start: float, end: float) -> dict[str, int]:
    """Evaluate every (title, expr); return {title: finite points}; fail naming every panel without data."""
    missing, points = [], {}
    for title, expr in exprs:
        promql = substitute(expr, RUN_NAME)
        n = finite_points(query_range(url, promql, start, end))
        points[f"{title}: {promql}"] = n
        if n == 0:
            missing.append(f"{title}: {promql}")
    assert not missing, "panels without data:\n  " + "\n  ".join(missing) + "\nscrape targets:\n  " + \
        "\n  ".join(scrape_health(url))
    return points


def scrape_health(url: str) -> list[str]:
    """Each scrape target's health and last error, as Prometheus reports them (for a failure's message)."""
    with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=10) as r:
        active = json.load(r)["data"]["activeTargets"]
    return [f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')!r} (last scrape {t.get('lastScrape')})"
            for t in active]


def variable_values(url: str, definition: str, start: float, end: float) -> list[str]:
    """Values of a `label_values(selector, label)` template variable, as Grafana asks Prometheus for them."""
    m = re.fullmatch(r"label_values\((.*), (\w+)\)", definition)
    assert m, definition
    q = urllib.parse.urlencode({"match[]": substitute(m.group(1), RUN_NAME), "start": f"{start:.3f}",
                                "end": f"{end:.3f}"})
    with urllib.request.urlopen(f"{url}/api/v1/label/{m.group(2)}/values?{q}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", f"{definition}: {body}"
    return body["data"]


DCGM_EXPOSITION = """\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
""" + "".join(
    f'{m}{{gpu="{g}",UUID="GPU-{g}",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",'
    f'container="trainer",namespace="default",pod="{RUN_NAME}-trainer-{g}-a0"}} {v}\n'
    for g in (0, 1) for m, v in (("DCGM_FI_DEV_GPU_UTIL", 87 + g), ("DCGM_FI_DEV_FB_USED", 40960),
                                 ("DCGM_FI_DEV_FB_FREE", 40000))) + (
    'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-9",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",'
    'Hostname="node-2",container="main",namespace="default",pod="someone-else-0"} 5\n')


@contextmanager
def dcgm_exporter_standin():
    """A static dcgm-exporter exposition (two GPUs of the run's trainer pods, one GPU of another pod) served over
    HTTP, for a real Prometheus to scrape: this machine has no GPU and no dcgm-exporter. Yields its host:port."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = DCGM_EXPOSITION.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # a scrape cut short (Prometheus timed out): ignore
            pass

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def check_per_step_panels(url: str, start: float, end: float) -> None:
    """Each trend panel, joined as Grafana joins it (its queries' samples at the same timestamps): the x values are
    real steps (or samples consumed) that never go back, and more than one step was seen."""
    for p in all_panels(dashboards()["run.json"]):
        if p["type"] != "trend":
            continue
        x_name = p["options"]["xField"]
        frames = {}
        for t in p["targets"]:
            (series,) = query_range(url, substitute(t["expr"], RUN_NAME), start, end)
            frames[t["legendFormat"]] = {float(ts): float(v) for ts, v in series["values"]}
        xs = frames.pop(x_name)
        for legend, ys in frames.items():
            joined = sorted((ts, xs[ts], y) for ts, y in ys.items() if ts in xs)
            assert len(joined) >= 2, f"{p['title']}: {legend} shares no scrape with {x_name}"
            x_values = [x for _, x, _ in joined]
            assert x_values == sorted(x_values), f"{p['title']}: {x_name} went back"
            assert len(set(x_values)) >= 2, f"{p['title']}: only one {x_name} seen"


@pytest.mark.megatron
def test_every_panel_returns_data_from_a_real_run_and_operator(tmp_path, redis):
    from tests.kube import Cluster
    from tests.services import free_port, metrics_ports, prometheus_server, stop_process, wait_for

    doc = yaml.safe_load((ROOT / "examples" / "rl.yaml").read_text())
    doc["metadata"] = {"name": RUN_NAME}
    doc["spec"]["rollout"]["numRollouts"] = NUM_ROLLOUTS
    doc["spec"]["trainer"]["policyLoss"] = {"oldLogprobs": "trainer", "rolloutCorrection": {"type": "tis"},
                                            "ratioLevel": "sequence", "entropyCoef": 0.001}
    # held-out evaluations (the Evaluation row): versions 0, 2, 4, 6
    doc["spec"]["rollout"]["eval"] = {"intervalRollouts": 2, "numPrompts": 8, "samplesPerPrompt": 4,
                                      "prompts": {"synthetic": {"task": "copy", "minLength": 2, "maxLength": 2}}}
    base = metrics_ports(3)
    doc["spec"]["metrics"]["port"] = base
    doc["spec"]["metrics"]["lingerSeconds"] = 1  # 10 scrapes of every process's final values
    spec = tmp_path / "dash.yaml"
    spec.write_text(yaml.safe_dump(doc))
    operator_port = free_port()
    run_targets = [f"127.0.0.1:{base + i}" for i in range(3)]  # rollout, trainer 0, trainer 1

    all_exprs = [te for d in dashboards().values() for te in targets(d)]
    run_exprs = [te for te in all_exprs if not is_operator_panel(te[1])]
    operator_exprs = [te for te in all_exprs if is_operator_panel(te[1])]

    log = tmp_path / "operator.log"
    with dcgm_exporter_standin() as dcgm, prometheus_server(
            run_targets + [f"127.0.0.1:{operator_port}", dcgm],
            scrape_interval=f"{SCRAPE_INTERVAL_MS}ms") as prom, Cluster() as cluster:
        operator = cluster.start_operator("--metrics-port", str(operator_port), log=log)
        try:
            t0 = time.time()
            # the operator reconciles a TrainingRun in the emulator; its pods are reported Running like a kubelet would
            k8s_run = copy.deepcopy(doc)
            k8s_run["metadata"] = {"name": RUN_NAME}  # the same name: the per-run operator panels filter by $run
            k8s_run["spec"]["store"] = {"url": redis.url}  # a store the operator reads the trainers' progress from
            cluster.create(cluster.tr_path(), k8s_run)
            wait_for(lambda: len(cluster.pods(RUN_NAME, role="trainer")) == 2, 30, "the operator's trainer pods")
            for pod in cluster.pods(RUN_NAME):  # rollout and trainers
                cluster.set_pod(pod["metadata"]["name"], "Running")
            # the cluster run's trainers report progress (two records: the operator's progress and ETA panels)
            env = {e["name"]: e.get("value") for e in cluster.pods(RUN_NAME, role="trainer")[0]["spec"]["containers"][0]
                   ["env"]}
            with closing(open_store(env["TRAININGRUN_STORE_URL"])) as store:
                for rollout, dt_s in ((0, 0.0), (1, 10.0)):
                    store.put_json("progress", {"step": rollout + 1, "samples_consumed": 8, "last_global_batch_size": 8,
                                                "rollout": rollout, "attempt": 0, "time": t0 + dt_s})
                    wait_for(lambda: (cluster.run(RUN_NAME).get("status") or {}).get("step") == rollout + 1, 30,
                             "the operator to read the progress")
            # a trainer pod fails: the operator restarts the group (the restart annotation's source), once Prometheus
            # has scraped the count before it (a loaded machine misses 100 ms scrapes)
            wait_for(lambda: prom.query(f'trainingrun_operator_run_restarts{{run="{RUN_NAME}"}} == 0'), 30,
                     "a scrape of the run's restart count")
            trainer0 = next(p["metadata"]["name"] for p in cluster.pods(RUN_NAME, role="trainer")
                            if p["metadata"]["labels"]["trainingrun.dev/rank"] == "0")
            cluster.set_pod(trainer0, "Failed", exit_code=1)
            wait_for(lambda: (cluster.run(RUN_NAME).get("status") or {}).get("restarts") == 1, 60,
                     "the operator to restart the group")
            # meanwhile: a real local run, scraped by the same Prometheus
            print(f"local run {RUN_NAME}: {NUM_ROLLOUTS} rollouts, metrics ports {base}..{base + 2}", flush=True)
            proc = subprocess.run(
                [sys.executable, "-m", "trainingrun", "run", str(spec), "--out", str(tmp_path / "run"),
                 "--progress-interval", "10"],
                cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT,
            )
            assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
            time.sleep(2)  # the last scrapes
            t1 = time.time()
            run_points = check_panels(prom.url, run_exprs, t0, t1)
            operator_points = check_panels(prom.url, operator_exprs, t0, t1)
            check_per_step_panels(prom.url, t0, t1)
            gpu = query_range(prom.url, substitute(f'max by (pod, gpu) (DCGM_FI_DEV_GPU_UTIL{{{DCGM_SEL}}})',
                                                   RUN_NAME), t0, t1)
            assert sorted(s["metric"]["pod"] for s in gpu) == [f"{RUN_NAME}-trainer-0-a0", f"{RUN_NAME}-trainer-1-a0"]
            # the pickers list the run and the operator's namespace of it (the local run has no namespace label)
            for d in dashboards().values():
                variables = {v["name"]: v for v in d["templating"]["list"]}
                assert RUN_NAME in variable_values(prom.url, variables["run"]["definition"], t0, t1)
                assert "default" in variable_values(prom.url, variables["namespace"]["definition"], t0, t1)
        finally:
            stop_process(operator)
    for title, n in {**run_points, **operator_points}.items():
        print(f"{n:5d} points  {title}")
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= NUM_ROLLOUTS - 1, "the run trained too few steps to be a meaningful check"
