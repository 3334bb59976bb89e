"""Generate the Grafana dashboards shipped with the chart (plain Python dicts -> JSON, schemaVersion 39).

    .venv/bin/python charts/trainingrun/dashboards/generate.py          # rewrite overview.json and run.json
    .venv/bin/python charts/trainingrun/dashboards/generate.py --check  # exit 1 if the files are out of date

Every query uses metric names defined in `trainingrun.metrics.names` (tests/integration/test_dashboards.py checks
it) and the dashboard variables `$namespace`, `$run` and `$datasource`. Weighted metrics (per-sample values exported per rank as counters `X_sum` / `X_count`) are shown as
`sum(rate(X_sum[$__rate_interval])) / sum(rate(X_count[$__rate_interval]))`, the correct mean over all ranks.
The panels' expressions are evaluated against a real Prometheus scraping a real local run by
tests/integration/test_dashboards.py.
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
          kind: str = "timeseries", stack: bool = False, decimals: int | None = None) -> dict:
    """One panel; position and id are assigned by `layout`."""
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
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(exprs)],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(items: list[dict]) -> list[dict]:
    """Place panels left to right on the 24-column grid: stats are 6 wide and 4 high, graphs 12 wide and 8 high."""
    x = y = 0
    line_h = 0
    out = []
    for pid, item in enumerate(items, start=1):
        w, h = {"row": (24, 1), "stat": (6, 4)}.get(item["type"], (12, 8))
        if item["type"] == "row" or x + w > 24:
            x, y, line_h = 0, y + line_h, 0
        item = {**item, "id": pid, "gridPos": {"h": h, "w": w, "x": x, "y": y}}
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
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "definition": query,
            "query": {"query": query, "refId": f"{name}-variable"},
            "refresh": 2,  # on time range change
            "sort": 1,
            "includeAll": True,
            "allValue": ".*",
            "multi": multi,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0,
            "options": [],
            "regex": "",
        }

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
                }
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
        row("Runs"),
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
    ]
    return dashboard("trainingrun-overview", "TrainingRun overview",
                     "All TrainingRuns: phases, restarts, operator health and per-run progress.", items, True)


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
        panel("Loss (weighted over ranks)",
              "Per-sample loss: Σ rate(sum) / Σ rate(count) over all ranks; the reported per-step loss for comparison.",
              [(weighted_mean("trainingrun_trainer_sample_loss"), "sample loss (weighted)"),
               (weighted_mean("trainingrun_trainer_token_loss"), "token loss (weighted)"),
               (f"max(trainingrun_trainer_loss{{{sel}}})", "step loss (rank 0)")]),
        panel("Reward (weighted over ranks)", "Mean sample reward: Σ rate(sum) / Σ rate(count).",
              [(weighted_mean("trainingrun_trainer_sample_reward"), "reward")]),
        row("Batch"),
        panel("Global batch size per step", "Samples in the last step (varies per step with dynamic sampling).",
              [(f"max(trainingrun_trainer_global_batch_size{{{sel}}})", "global batch size")], decimals=0),
        panel("Micro-batches per rank", "Micro-batches each rank ran in the last step.",
              [(f"max(trainingrun_trainer_num_microbatches{{{sel}}})", "micro-batches")], decimals=0),
        row("Throughput"),
        panel("Samples and tokens per second", "Throughput of the last step over all ranks.",
              [(f"max(trainingrun_trainer_samples_per_second{{{sel}}})", "samples/s"),
               (f"max(trainingrun_trainer_tokens_per_second{{{sel}}})", "tokens/s")]),
        panel("Per-rank throughput", "Tokens per second of each data-parallel rank (a slow rank stands out).",
              [(f"sum by (rank) (rate({counter('trainingrun_trainer_rank_tokens')}{{{sel}}}[$__rate_interval]))",
                "rank {{rank}}")]),
        panel("Step time", "Wall time of the last step.",
              [(f"max(trainingrun_trainer_step_seconds{{{sel}}})", "step time")], unit="s"),
        panel("Schedule imbalance", "max / mean rank token load of the last published step (1 = balanced).",
              [(f"max(trainingrun_rollout_schedule_imbalance{{{sel}}})", "imbalance")]),
        row("Optimizer"),
        panel("Learning rate", "LR used by the last step (the scheduler advances by each step's batch size).",
              [(f"max(trainingrun_trainer_lr{{{sel}}})", "lr")], unit="sci"),
        panel("Gradient norm", "Gradient norm of the last step, before clipping.",
              [(f"max(trainingrun_trainer_grad_norm{{{sel}}})", "grad norm")]),
        row("Rollout"),
        panel("Samples produced, filtered, published", "Rollout sample flow per second.",
              [(f"sum(rate({counter('trainingrun_rollout_samples_produced')}{{{sel}}}[$__rate_interval]))",
                "produced"),
               (f"sum(rate({counter('trainingrun_rollout_samples_filtered')}{{{sel}}}[$__rate_interval]))",
                "filtered"),
               (f"sum(rate({counter('trainingrun_rollout_samples_published')}{{{sel}}}[$__rate_interval]))",
                "published")], unit="ops"),
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
