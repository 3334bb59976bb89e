"""Generate the Grafana dashboards shipped with the chart (plain Python dicts -> JSON, schemaVersion 39).

    .venv/bin/python charts/trainingrun/dashboards/generate.py          # rewrite overview.json and run.json
    .venv/bin/python charts/trainingrun/dashboards/generate.py --check  # exit 1 if the files are out of date

Every query uses metric names defined in `trainingrun.metrics.names` (tests/integration/test_dashboards.py checks
it) and the dashboard variables `$namespace`, `$run` and `$datasource`. Weighted metrics (per-sample values exported per rank as counters `X_sum` / `X_count`) are shown as
`sum(rate(X_sum[$__rate_interval])) / sum(rate(X_count[$__rate_interval]))`, the correct mean over all ranks.
The panels' expressions are evaluated against a real Prometheus scraping a real local run by
tests/integration/test_dashboards.py.

Per-step values (loss, global batch size, lr, grad norm, micro-batches, step time) are rank 0's gauges of the last
step. They are drawn against the step, not against wall-clock time: a `trend` panel joins each gauge with
`trainingrun_trainer_step` (or `trainingrun_trainer_samples_consumed` for the learning rate) scraped at the same
instant and plots points (bars for the batch size) at x = step. A scrape still sees only the steps that were current
when it ran; every step is in TensorBoard / W&B / `trainingrun plot` (docs/metrics.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
RUN_SEL = 'namespace=~"$namespace", run=~"$run"'
NS_SEL = 'namespace=~"$namespace"'


def counter(name: str) -> str:
    """Exposition name of a counter (the Prometheus client appends `_total`)."""
    return f"{name}_total"


def sparse_weighted_mean(base: str) -> str:
    """`weighted_mean` of a pair that may not be counted at all (a run without multi-turn episodes): 0 then."""
    return (f"sum(rate({base}_sum{{{RUN_SEL}}}[$__rate_interval]))"
            f" / clamp_min(sum(rate({base}_count{{{RUN_SEL}}}[$__rate_interval])), 1e-9)")


def weighted_mean(base: str, by: str = "") -> str:
    """Correct mean of a weighted metric over all matching ranks: Σ rate(sum) / Σ rate(count)."""
    group = f" by ({by})" if by else ""
    return (
        f"sum{group}(rate({base}_sum{{{RUN_SEL}}}[$__rate_interval]))"
        f" / sum{group}(rate({base}_count{{{RUN_SEL}}}[$__rate_interval]))"
    )


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(title: str, description: str, exprs: list[tuple[str, str]], *, unit: str = "short",
          kind: str = "timeseries", stack: bool = False, decimals: int | None = None,
          right_axis: dict[str, str] | None = None) -> dict:
    """One panel; position and id are assigned by `layout`. `right_axis`: {legend: unit} of series drawn on a second
    y axis on the right (e.g. tokens/s beside samples/s)."""
    defaults: dict = {"unit": unit, "color": {"mode": "palette-classic"}}
    if decimals is not None:
        defaults["decimals"] = decimals
    options: dict
    if kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if stack else 0,
            "showPoints": "never",
            "spanNulls": True,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        }
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:  # stat
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        }
    overrides = [
        {"matcher": {"id": "byName", "options": legend},
         "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": axis_unit},
                        {"id": "custom.axisLabel", "value": legend}]}
        for legend, axis_unit in (right_axis or {}).items()
    ]
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": options,
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(exprs)],
    }


STEP_X = ("trainingrun_trainer_step", "step")
EVAL_STEP_X = ("trainingrun_eval_step", "step")
SAMPLES_X = ("trainingrun_trainer_samples_consumed", "samples consumed")


def per_step_panel(title: str, description: str, exprs: list[tuple[str, str]], *, x: tuple[str, str] = STEP_X,
                   unit: str = "short", bars: bool = False, decimals: int | None = None) -> dict:
    """A trend panel: each rank-0 gauge in `exprs` against another gauge of the same scrape (x: the step, or the
    samples consumed), joined on the scrape time. Points (or bars) at each scraped step, not a wall-clock line."""
    metric, x_name = x
    p = panel(title, description, [*exprs, (f"max({metric}{{{RUN_SEL}}})", x_name)], unit=unit, decimals=decimals)
    p["type"] = "trend"
    p["fieldConfig"]["defaults"]["custom"] = {
        "drawStyle": "bars" if bars else "points",
        "pointSize": 6,
        "lineWidth": 1,
        "fillOpacity": 60 if bars else 0,
        "showPoints": "always",
        "spanNulls": False,
        "axisLabel": "",
    }
    p["options"] = {
        "xField": x_name,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "none"},
    }
    # One row per scrape: every gauge of a step is scraped from rank 0 at the same instant.
    p["transformations"] = [{"id": "joinByField", "options": {"byField": "Time", "mode": "inner"}},
                            {"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    return p


def run_table() -> dict:
    """Runs as `kubectl get tr` lists them: namespace, name, phase, step, last global batch size, samples, restarts,
    progress and its estimated time remaining."""
    exprs = [
        (f"max by (namespace, run, phase) (trainingrun_operator_run_phase{{{RUN_SEL}}}) == 1", "phase"),
        (f"max by (namespace, run) (trainingrun_operator_run_step{{{RUN_SEL}}})", "step"),
        (f"max by (namespace, run) (trainingrun_trainer_global_batch_size{{{RUN_SEL}}})", "gbs"),
        (f"max by (namespace, run) (trainingrun_trainer_samples_consumed{{{RUN_SEL}}})", "samples"),
        (f"max by (namespace, run) (trainingrun_operator_run_restarts{{{RUN_SEL}}})", "restarts"),
        (f"max by (namespace, run) (trainingrun_operator_run_progress_percent{{{RUN_SEL}}})", "progress"),
        (f"max by (namespace, run) (trainingrun_operator_run_eta_seconds{{{RUN_SEL}}})", "eta"),
    ]
    p = panel("TrainingRuns", "The selected runs as `kubectl get tr` lists them (the operator's view of phase, step, "
              "restarts and progress; global batch size and samples from the trainers).", exprs, kind="table")
    for t in p["targets"]:
        t.update({"format": "table", "instant": True, "range": False})
    p["options"] = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]},
                    "sortBy": [{"displayName": "NAME", "desc": False}]}
    p["transformations"] = [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value #A": True},
            "indexByName": {"namespace": 0, "run": 1, "phase": 2, "Value #B": 3, "Value #C": 4, "Value #D": 5,
                            "Value #E": 6, "Value #F": 7, "Value #G": 8},
            "renameByName": {"namespace": "NAMESPACE", "run": "NAME", "phase": "PHASE", "Value #B": "STEP",
                             "Value #C": "GBS", "Value #D": "SAMPLES", "Value #E": "RESTARTS",
                             "Value #F": "PROGRESS", "Value #G": "ETA"},
        }},
    ]
    p["fieldConfig"]["defaults"]["decimals"] = 0
    return p


# dcgm-exporter's metrics (https://github.com/NVIDIA/dcgm-exporter), labelled with the pod that uses the GPU. The
# run's pods are named <run>-trainer-<rank>-a<attempt> and <run>-rollout-a<attempt> (operator/render.py).
DCGM_SEL = 'namespace=~"$namespace", pod=~"$run-(trainer|rollout)-.+"'
DCGM_METRICS = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE")


def gpu_row() -> dict:
    """A collapsed row of GPU panels from dcgm-exporter, for clusters that run it (empty otherwise)."""
    r = row("GPU (dcgm-exporter)")
    r["collapsed"] = True
    r["panels"] = [
        panel("GPU utilisation", "DCGM_FI_DEV_GPU_UTIL of each GPU of the run's pods (needs dcgm-exporter with "
              "pod labels).", [(f"max by (pod, gpu) (DCGM_FI_DEV_GPU_UTIL{{{DCGM_SEL}}})", "{{pod}} gpu {{gpu}}")],
              unit="percent"),
        panel("GPU memory used", "Frame-buffer memory in use per GPU (DCGM_FI_DEV_FB_USED, MiB) against the "
              "GPU's total (used + free).",
              [(f"max by (pod, gpu) (DCGM_FI_DEV_FB_USED{{{DCGM_SEL}}}) * 1048576", "{{pod}} gpu {{gpu}}"),
               (f"max by (pod, gpu) (DCGM_FI_DEV_FB_USED{{{DCGM_SEL}}} + DCGM_FI_DEV_FB_FREE{{{DCGM_SEL}}})"
                " * 1048576", "{{pod}} gpu {{gpu}} total")], unit="bytes"),
    ]
    return r


# Restarts as annotations: a mark wherever the operator's restart count of a selected run went up in the last minute.
RESTART_ANNOTATION = {
    "name": "Restarts",
    "datasource": DS,
    "enable": True,
    "hide": False,
    "iconColor": "red",
    "expr": f"changes(trainingrun_operator_run_restarts{{{RUN_SEL}}}[1m]) > 0",
    "step": "30s",
    "titleFormat": "restart",
    "textFormat": "{{namespace}}/{{run}}: the group was restarted",
    "tagKeys": "namespace,run",
    "useValueForTime": False,
}


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(items: list[dict]) -> list[dict]:
    """Place panels left to right on the 24-column grid: stats are 6 wide and 4 high, graphs 12 wide and 8 high."""
    x = y = 0
    line_h = 0
    out = []
    pid = 0
    for item in items:
        pid += 1
        w, h = {"row": (24, 1), "stat": (6, 4), "table": (24, 7)}.get(item["type"], (12, 8))
        if item["type"] == "row" or x + w > 24:
            x, y, line_h = 0, y + line_h, 0
        item = {**item, "id": pid, "gridPos": {"h": h, "w": w, "x": x, "y": y}}
        if item["type"] == "row" and item.get("panels"):  # a collapsed row: its panels sit below it when opened
            nested = []
            for i, sub in enumerate(item["panels"]):
                pid += 1
                nested.append({**sub, "id": pid, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 1 + 8 * (i // 2)}})
            item["panels"] = nested
        out.append(item)
        x += w
        line_h = max(line_h, h)
        if item["type"] == "row":
            x, y, line_h = 0, y + h, 0
    return out


def variables(run_multi: bool) -> dict:
    # Runs known to the trainers' metrics or to the operator (which also lists runs that never trained, e.g. Failed).
    runs = '__name__=~"trainingrun_trainer_step|trainingrun_operator_run_phase"'
    ns_query = f"label_values({{{runs}}}, namespace)"
    run_query = f"label_values({{{runs}, {NS_SEL}}}, run)"

    def query_var(name: str, label: str, query: str, multi: bool) -> dict:
        var = {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-variable"},
            "refresh": 2,  # on time range change
            "sort": 1,
            "includeAll": multi,
            "multi": multi,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {},
            "hide": 0,
            "options": [],
            "regex": "",
        }
        if multi:
            var["allValue"] = ".*"
        return var

    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "includeAll": False,
                "multi": False,
                "options": [],
                "refresh": 1,
                "regex": "",
            },
            query_var("namespace", "Namespace", ns_query, True),
            # One run on the run-detail dashboard (its per-step panels would mix runs); several on the overview.
            query_var("run", "Run", run_query, run_multi),
        ]
    }


def dashboard(uid: str, title: str, description: str, items: list[dict], run_multi: bool) -> dict:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["trainingrun"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                RESTART_ANNOTATION,
            ]
        },
        "links": [
            {"title": "TrainingRun dashboards", "type": "dashboards", "tags": ["trainingrun"], "asDropdown": False,
             "includeVars": True, "keepTime": True}
        ],
        "templating": variables(run_multi),
        "panels": layout(items),
    }


def overview() -> dict:
    # Per-run operator series (labels namespace, run) follow $namespace / $run; `max by` drops the operator pod's
    # labels (two series for a moment when the operator pod is replaced). Reconcile latency and errors describe the
    # operator itself and are not filtered.
    items = [
        row("Runs"),
        run_table(),
        row("Operator"),
        panel("Runs by phase", "Selected TrainingRuns per phase, as the operator observes them.",
              [(f"sum by (phase) (max by (namespace, run, phase) (trainingrun_operator_run_phase{{{RUN_SEL}}}))",
                "{{phase}}")], stack=True, decimals=0),
        panel("Group restarts", "Whole-group restarts of each selected run so far (status.restarts).",
              [(f"max by (namespace, run) (trainingrun_operator_run_restarts{{{RUN_SEL}}})", "{{namespace}}/{{run}}")],
              decimals=0),
        panel("Reconcile latency", "Handler duration quantiles from the operator's histogram.",
              [(f"histogram_quantile({q}, sum by (le) (rate(trainingrun_operator_reconcile_seconds_bucket"
                f"[$__rate_interval])))", f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)], unit="s"),
        panel("Operator errors", "Handler errors per second, by handler (0 when no handler ever failed).",
              [("sum by (handler) (rate(" + counter("trainingrun_operator_errors") + "[$__rate_interval]))"
                " or on() vector(0)", "{{handler}}")], unit="ops"),
        row("Progress"),
        panel("Progress", "Rollouts trained in percent of rollout.numRollouts, per run (status.progress.percentage).",
              [(f"max by (namespace, run) (trainingrun_operator_run_progress_percent{{{RUN_SEL}}})",
                "{{namespace}}/{{run}}")], unit="percent", decimals=0),
        panel("Estimated time remaining", "The remaining rollouts at the pace of the current attempt, per run "
              "(status.progress.estimatedRemainingSeconds).",
              [(f"max by (namespace, run) (trainingrun_operator_run_eta_seconds{{{RUN_SEL}}})",
                "{{namespace}}/{{run}}")], unit="s", decimals=0),
        panel("Optimizer step", "Steps completed, per run.",
              [(f"max by (namespace, run) (trainingrun_trainer_step{{{RUN_SEL}}})", "{{namespace}}/{{run}}")],
              decimals=0),
        panel("Samples consumed", "Samples trained on so far, per run.",
              [(f"max by (namespace, run) (trainingrun_trainer_samples_consumed{{{RUN_SEL}}})",
                "{{namespace}}/{{run}}")], decimals=0),
        panel("Loss (weighted over ranks)", "Σ rate(loss_sum) / Σ rate(loss_count) per run.",
              [(weighted_mean("trainingrun_trainer_sample_loss", by="namespace, run"), "{{namespace}}/{{run}}")]),
        panel("Tokens per second", "Training throughput per run (all ranks).",
              [(f"sum by (namespace, run) (rate({counter('trainingrun_trainer_rank_tokens')}{{{RUN_SEL}}}"
                f"[$__rate_interval]))", "{{namespace}}/{{run}}")], unit="short"),
        gpu_row(),
    ]
    return dashboard("trainingrun-overview", "TrainingRun overview",
                     "All TrainingRuns: phases, restarts, operator health and per-run progress.", items, True)


def agent_panels(sel: str) -> list[dict]:
    """The "Agents (gateway)" row of the run detail (rollout.source.generate.agent; 0 without an agent)."""
    seconds = "trainingrun_rollout_gateway_request_seconds"
    return [
        row("Agents (gateway)"),
        panel("Agent failures by reason", "Agent episodes that failed, per second, by reason (exit, timeout, "
              "no_reward, invalid, limit, engine, error; 0 when none ever failed).",
              [("sum by (reason) (rate(" + counter("trainingrun_rollout_agent_failures") + f"{{{sel}}}"
                "[$__rate_interval])) or on() vector(0)", "{{reason}}")], unit="ops"),
        panel("Gateway request latency", "Seconds from a chat request's arrival at the gateway to its answer: the "
              "mean and the 95th percentile (0 without requests).",
              [(sparse_weighted_mean(seconds), "mean"),
               (f"(histogram_quantile(0.95, sum by (le) (rate({seconds}_bucket{{{sel}}}[$__rate_interval]))) >= 0)"
                " or on() vector(0)", "p95")], unit="s"),
        panel("Failed, rewritten and refused", "Share of agent episodes that failed, token sequences an episode "
              "started by rewriting its history (per episode), and requests refused for a key of no running "
              "episode (per second).",
              [(sparse_weighted_mean("trainingrun_rollout_agent_failure_rate"), "failed / episode"),
               (sparse_weighted_mean("trainingrun_rollout_rewrites_per_episode"), "rewrites / episode"),
               (f"sum(rate({counter('trainingrun_rollout_gateway_unauthorized')}{{{sel}}}[$__rate_interval]))",
                "401 / s")]),
    ]


def run_detail() -> dict:
    sel = RUN_SEL
    items = [
        panel("Step", "Optimizer steps completed.", [(f"max(trainingrun_trainer_step{{{sel}}})", "step")],
              kind="stat", decimals=0),
        panel("Samples consumed", "Samples trained on so far.",
              [(f"max(trainingrun_trainer_samples_consumed{{{sel}}})", "samples")], kind="stat", decimals=0),
        panel("Rollout", "Rollout being trained.", [(f"max(trainingrun_trainer_rollout{{{sel}}})", "rollout")],
              kind="stat", decimals=0),
        panel("Pending rollouts", "Published rollouts not yet consumed by the trainers.",
              [(f"max(trainingrun_rollout_pending{{{sel}}})", "pending")], kind="stat", decimals=0),
        row("Loss"),
        per_step_panel("Loss per step", "The step's loss (the objective J_s, rank 0, reduced over all ranks) at "
                       "each scraped step.", [(f"max(trainingrun_trainer_loss{{{sel}}})", "step loss")]),
        panel("Loss (weighted over ranks)",
              "Per-sample and per-token loss over time: Σ rate(sum) / Σ rate(count) over all ranks (every step "
              "counts, weighted by its samples).",
              [(weighted_mean("trainingrun_trainer_sample_loss"), "sample loss (weighted)"),
               (weighted_mean("trainingrun_trainer_token_loss"), "token loss (weighted)")]),
        panel("Reward (weighted over ranks)", "Mean sample reward: Σ rate(sum) / Σ rate(count).",
              [(weighted_mean("trainingrun_trainer_sample_reward"), "reward")]),
        row("Batch"),
        per_step_panel("Global batch size per step", "Samples in each scraped step (varies per step with dynamic "
                       "sampling).", [(f"max(trainingrun_trainer_global_batch_size{{{sel}}})", "global batch size")],
                       bars=True, decimals=0),
        per_step_panel("Micro-batches per rank", "Micro-batches each rank ran in each scraped step.",
                       [(f"max(trainingrun_trainer_num_microbatches{{{sel}}})", "micro-batches")], decimals=0),
        row("Throughput"),
        panel("Samples and tokens per second", "Throughput of the last step over all ranks: samples/s on the left "
              "axis, tokens/s on the right.",
              [(f"max(trainingrun_trainer_samples_per_second{{{sel}}})", "samples/s"),
               (f"max(trainingrun_trainer_tokens_per_second{{{sel}}})", "tokens/s")],
              right_axis={"tokens/s": "short"}),
        panel("Per-rank throughput", "Tokens per second of each data-parallel rank (a slow rank stands out).",
              [(f"sum by (rank) (rate({counter('trainingrun_trainer_rank_tokens')}{{{sel}}}[$__rate_interval]))",
                "rank {{rank}}")]),
        per_step_panel("Step time", "Wall time of each scraped step.",
                       [(f"max(trainingrun_trainer_step_seconds{{{sel}}})", "step time")], unit="s"),
        panel("Schedule imbalance", "max / mean rank token load of the last published step (1 = balanced).",
              [(f"max(trainingrun_rollout_schedule_imbalance{{{sel}}})", "imbalance")]),
        row("Optimizer"),
        per_step_panel("Learning rate vs samples consumed", "LR of each scraped step against the samples consumed "
                       "(the scheduler advances by each step's batch size).",
                       [(f"max(trainingrun_trainer_lr{{{sel}}})", "lr")], x=SAMPLES_X, unit="sci"),
        per_step_panel("Gradient norm per step", "Gradient norm of each scraped step, before clipping.",
                       [(f"max(trainingrun_trainer_grad_norm{{{sel}}})", "grad norm")]),
        row("Policy (generated rollouts)"),
        panel("Train–inference mismatch", "KL(π_engine ‖ π_trainer) estimate (k3) and |engine logprob − trainer "
              "logprob| per trained token, before the update: Σ rate(sum) / Σ rate(count) over all ranks.",
              [(weighted_mean("trainingrun_trainer_mismatch_kl"), "mismatch KL"),
               (weighted_mean("trainingrun_trainer_logprob_abs_diff"), "|Δ logprob|")],
              right_axis={"|Δ logprob|": "short"}),
        panel("Rollout correction", "trainer.policyLoss.rolloutCorrection: mean weight per trained token (tis: "
              "min(ρ, threshold); mask: 1 kept, 0 masked), the last step's largest weight, and the masked fraction.",
              [(weighted_mean("trainingrun_trainer_correction_weight"), "weight (mean)"),
               (f"max(trainingrun_trainer_correction_weight_max{{{sel}}})", "weight (max, last step)"),
               (weighted_mean("trainingrun_trainer_masked_fraction"), "masked fraction")]),
        panel("Ratio and clipping", "π/π_old per trained token, the fractions of tokens the clip and the dual clip "
              "(a negative advantage's term capped at −A·clipRatioC) act on and — ratioLevel sequence (GSPO) — the "
              "fraction of sequences whose ratio was clipped.",
              [(weighted_mean("trainingrun_trainer_importance_ratio"), "ratio"),
               (weighted_mean("trainingrun_trainer_clip_fraction"), "tokens clipped"),
               (weighted_mean("trainingrun_trainer_dual_clip_fraction"), "tokens dual-clipped"),
               (weighted_mean("trainingrun_trainer_seq_clip_fraction"), "sequences clipped")]),
        panel("Entropy", "The policy's entropy at the trained tokens and the entropy bonus (entropyCoef · entropy, "
              "subtracted from the loss).",
              [(weighted_mean("trainingrun_trainer_entropy"), "entropy"),
               (weighted_mean("trainingrun_trainer_entropy_bonus"), "entropy bonus")]),
        row("Rollout"),
        panel("Engine pool size", "The run's own engine replicas over time: the pool's size as the operator runs it "
              "(status.engineReplicas; it follows spec.rollout.engine.replicas, e.g. `kubectl scale tr/NAME`); 0 for "
              "a run without engine servers of its own.",
              [(f"max(trainingrun_operator_run_engine_replicas{{{sel}}}) or on() vector(0)", "engines")],
              decimals=0),
        panel("Samples produced, filtered, published", "Rollout sample flow per second.",
              [(f"sum(rate({counter('trainingrun_rollout_samples_produced')}{{{sel}}}[$__rate_interval]))",
                "produced"),
               (f"sum(rate({counter('trainingrun_rollout_samples_filtered')}{{{sel}}}[$__rate_interval]))",
                "filtered"),
               (f"sum(rate({counter('trainingrun_rollout_samples_published')}{{{sel}}}[$__rate_interval]))",
                "published")], unit="ops"),
        panel("Prefix-cache hit rate per engine", "Prompt tokens each engine found in its prefix cache over those it "
              "looked up (its own counters): rate(hits) / rate(queries). Multi-turn episodes are routed to the engine "
              "of their previous turn (0 with an in-process engine).",
              [(f"sum by (engine) (rate({counter('trainingrun_rollout_engine_prefix_cache_hits')}{{{sel}}}"
                "[$__rate_interval])) / clamp_min(sum by (engine) (rate("
                + counter("trainingrun_rollout_engine_prefix_cache_queries") + f"{{{sel}}}[$__rate_interval])), "
                "1e-9) or on() vector(0)", "{{engine}}")], unit="percentunit"),
        panel("Requests in flight per engine", "Mean requests the rollout kept in flight at each engine while "
              "generating the last rollout, and each engine's in-flight limit (engine.vllm.concurrency, or the "
              "limit auto adapted to from the engine's KV cache and queue; 0 with an in-process engine).",
              [(f"max by (engine) (trainingrun_rollout_engine_inflight{{{sel}}}) or on() vector(0)",
                "{{engine}} in flight"),
               (f"max by (engine) (trainingrun_rollout_engine_concurrency{{{sel}}}) or on() vector(0)",
                "{{engine}} limit")]),
        panel("Weight sync", "The last weight sync (spec.weightSync): seconds on trainer rank 0 (gather, write or "
              "pack, commit) and the longest time the engines generated nothing while they loaded the version, on "
              "the left; its rate in GB/s (1e9 bytes per second of the published bytes) on the right.",
              [(f"max(trainingrun_trainer_weight_sync_seconds{{{sel}}})", "sync seconds"),
               (f"max(trainingrun_trainer_weight_sync_pause_seconds{{{sel}}})", "engine pause seconds"),
               (f"max(trainingrun_trainer_weight_sync_gbps{{{sel}}})", "GB/s")],
              unit="s", right_axis={"GB/s": "short"}),
        row("Evaluation (held-out prompts)"),
        per_step_panel("Held-out reward and pass@k", "rollout.eval: the last evaluation's mean reward, pass@1 and "
                       "pass@k (k = samplesPerPrompt) on the held-out prompts, at the step its weights were trained "
                       "to (every evaluation is in eval.jsonl and TensorBoard eval/*).",
                       [(f"max(trainingrun_eval_reward_mean{{{sel}}})", "reward mean"),
                        (f"max(trainingrun_eval_pass_at_1{{{sel}}})", "pass@1"),
                        (f"max(trainingrun_eval_pass_at_k{{{sel}}})", "pass@k")], x=EVAL_STEP_X),
        panel("Evaluated weight version", "Weight version of the last evaluation.",
              [(f"max(trainingrun_eval_weight_version{{{sel}}})", "version")], kind="stat", decimals=0),
        panel("Evaluation time and length", "Wall time of the last evaluation (generation and scoring, between "
              "training rollouts) and its completion tokens per completion (right axis).",
              [(f"max(trainingrun_eval_seconds{{{sel}}})", "seconds"),
               (f"max(trainingrun_eval_response_length_mean{{{sel}}})", "tokens / completion")],
              unit="s", right_axis={"tokens / completion": "short"}),
        panel("Evaluation rewards failed", "Evaluation rewards that failed, per second, by reason.",
              [("sum by (reason) (rate(" + counter("trainingrun_eval_reward_failures") + f"{{{sel}}}"
                "[$__rate_interval]))", "{{reason}}")], unit="ops"),
        row("Multi-turn episodes"),
        panel("Turns and tool calls per episode", "Model turns and tool calls per episode: Σ rate(sum) / Σ "
              "rate(count) over episodes (0 without an environment).",
              [(sparse_weighted_mean("trainingrun_rollout_turns_per_episode"), "turns"),
               (sparse_weighted_mean("trainingrun_rollout_tool_calls_per_episode"), "tool calls")]),
        panel("Tool errors, truncated and failed episodes", "Share of tool calls answered with an error, and of "
              "episodes truncated (maxTurns or the token cap) or failed in their environment.",
              [(sparse_weighted_mean("trainingrun_rollout_tool_error_rate"), "tool errors / call"),
               (sparse_weighted_mean("trainingrun_rollout_truncated_rate"), "truncated / episode"),
               (sparse_weighted_mean("trainingrun_rollout_env_failure_rate"), "failed / episode")],
              unit="percentunit"),
        panel("Environment failures by reason", "Episodes whose environment failed, per second, by reason "
              "(0 when none ever failed).",
              [("sum by (reason) (rate(" + counter("trainingrun_rollout_environment_failures") + f"{{{sel}}}"
                "[$__rate_interval])) or on() vector(0)", "{{reason}}")], unit="ops"),
        panel("Response tokens per turn", "Tokens the model generated per turn: Σ rate(sum) / Σ rate(count).",
              [(sparse_weighted_mean("trainingrun_rollout_response_tokens_per_turn"), "tokens / turn")]),
        *agent_panels(sel),
        gpu_row(),
    ]
    return dashboard("trainingrun-run", "TrainingRun run detail",
                     "One TrainingRun: weighted loss, batch sizes, throughput, optimizer and schedule balance.",
                     items, False)


DASHBOARDS = {"overview.json": overview, "run.json": run_detail}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> int:
    stale = []
    for name, text in render().items():
        path = HERE / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run: .venv/bin/python {Path(__file__).relative_to(HERE.parents[2])}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
