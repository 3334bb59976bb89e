"""`trainingrun plot RUN_DIR [--output FILE]`: one PNG of a run's per-step history.

Six panels: loss per step, global batch size per step (bars: it varies), learning rate against samples consumed (the
scheduler advances by samples), gradient norm, reward (the trained samples' mean, the mean over every generated
sample when the record has `reward_mean`, and with `rollout.eval` the evaluations on held-out prompts from
eval.jsonl: their reward mean, pass@1 and pass@k at the step their weights were trained to), throughput (samples/s
and tokens/s on their own axes). Dashed vertical lines mark restarts (the step where another attempt's records
begin). The history comes from the run directory (`trainingrun.local.history`): a local run's directory, or a
cluster's output directory with its metrics.jsonl.
A finished local run writes `RUN_DIR/plot.png` itself.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainingrun.contract.evaluation import EvalRecord
from trainingrun.local.history import eval_records, restart_steps, step_records

PLOT_FILE = "plot.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (with metrics.jsonl or raw/)")
    parser.add_argument("--output", "-o", metavar="FILE", help=f"PNG to write (default: RUN_DIR/{PLOT_FILE})")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir}: not a directory", file=sys.stderr)
        return 1
    records = step_records(run_dir)
    if not records:
        print(f"error: {run_dir}: no step records (metrics.jsonl or raw/trainer-metrics.attempt*.jsonl)",
              file=sys.stderr)
        return 1
    out = Path(args.output) if args.output else run_dir / PLOT_FILE
    try:  # deferred: matplotlib (the optional `local` extra)
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: trainingrun plot needs matplotlib: pip install 'trainingrun[local]'", file=sys.stderr)
        return 1
    try:
        write_plot(records, out, title=run_dir.resolve().name, evals=eval_records(run_dir))
    except OSError as exc:
        print(f"error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({len(records)} steps)")
    return 0


def _series(records: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the records that have a finite number in `key` (and `x`)."""
    xs, ys = [], []
    for r in records:
        a, b = r.get(x), r.get(key)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(b, bool) \
                and math.isfinite(b):
            xs.append(float(a))
            ys.append(float(b))
    return xs, ys


def figure(records: list[dict[str, Any]], title: str = "", evals: Sequence[EvalRecord] = ()):
    """The matplotlib Figure (Agg backend, nothing shown); `evals`: the run's evaluations (eval.jsonl)."""
    import matplotlib  # deferred: matplotlib (the optional `local` extra), slow to import

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # deferred: after choosing the Agg backend

    fig = Figure(figsize=(15, 8.5), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3)
    last = records[-1]
    fig.suptitle(f"{title}  —  {len(records)} steps, {last.get('samples_consumed', '?')} samples"
                 if title else f"{len(records)} steps", fontsize=13)
    restarts = restart_steps(records)

    def mark_restarts(ax) -> None:
        for i, (step, attempt) in enumerate(restarts):
            ax.axvline(step - 0.5, color="0.4", linestyle="--", linewidth=1,
                       label="restart" if i == 0 else None)

    def line(ax, key: str, label: str, **kw) -> bool:
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) <= 200 else None, label=label, **kw)
        return bool(xs)

    def no_data(ax, what: str) -> None:
        ax.text(0.5, 0.5, f"no {what} in the records", ha="center", va="center", transform=ax.transAxes,
                color="0.5")

    ax = axes[0][0]
    ax.set_title("loss")
    if not line(ax, "loss", "loss"):
        no_data(ax, "loss")
    mark_restarts(ax)

    ax = axes[0][1]
    ax.set_title("global batch size per step")
    xs, ys = _series(records, "global_batch_size")
    if xs:
        ax.bar(xs, ys, width=0.8, color="tab:orange", label="samples in the step")
    else:
        no_data(ax, "global_batch_size")
    ax.set_ylabel("samples")
    mark_restarts(ax)

    ax = axes[0][2]
    ax.set_title("learning rate vs samples consumed")
    xs, ys = _series(records, "lr", x="samples_consumed")
    if xs:
        ax.plot(xs, ys, marker="." if len(xs) <= 200 else None, color="tab:green")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    else:
        no_data(ax, "lr / samples_consumed")
    ax.set_xlabel("samples consumed")

    ax = axes[1][0]
    ax.set_title("gradient norm (before clipping)")
    if not line(ax, "grad_norm", "grad norm", color="tab:red"):
        no_data(ax, "grad_norm")
    mark_restarts(ax)

    ax = axes[1][1]
    ax.set_title("reward")
    has = line(ax, "reward", "trained samples (mean)", color="tab:purple")
    has = line(ax, "reward_mean", "all generated samples (mean)", color="tab:brown") or has
    if evals:
        steps = [e.step for e in evals]
        k = evals[-1].k
        ax.plot(steps, [e.reward_mean for e in evals], "s-", color="tab:green", label="held-out eval: reward mean")
        ax.plot(steps, [e.pass_at_1 for e in evals], "^--", color="tab:olive", label="held-out eval: pass@1")
        ax.plot(steps, [e.pass_at_k for e in evals], "v:", color="tab:gray", label=f"held-out eval: pass@{k}")
        has = True
    if not has:
        no_data(ax, "reward")
    mark_restarts(ax)

    ax = axes[1][2]
    ax.set_title("throughput")
    has = line(ax, "samples_per_second", "samples/s", color="tab:blue")
    ax.set_ylabel("samples/s", color="tab:blue")
    ax2 = ax.twinx()
    xs, ys = _series(records, "tokens_per_second")
    if xs:
        ax2.plot(xs, ys, color="tab:cyan", marker="." if len(xs) <= 200 else None, label="tokens/s")
    ax2.set_ylabel("tokens/s", color="tab:cyan")
    if not (has or xs):
        no_data(ax, "throughput")
    mark_restarts(ax)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    if h1 or h2:
        ax.legend(h1 + h2, l1 + l2, loc="best", fontsize=8)
    throughput = ax

    for row in axes:
        for a in row:
            a.grid(True, alpha=0.3)
            if a is not axes[0][2]:
                a.set_xlabel(a.get_xlabel() or "step")
            handles, _ = a.get_legend_handles_labels()
            if a is not throughput and (len(handles) > 1 or (handles and restarts)):
                a.legend(loc="best", fontsize=8)
    return fig


def write_plot(records: list[dict[str, Any]], path: Path, title: str = "", evals: Sequence[EvalRecord] = ()) -> Path:
    """Write the PNG atomically (a temporary file, then rename)."""
    fig = figure(records, title, evals)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path
