"""What a local run reports: the merged per-step metrics, live progress, the summary file and table.

Rank 0 of each attempt appends one JSON object per step to its own raw file (`raw/trainer-metrics.attempt<k>.jsonl`,
given to it as TRAININGRUN_METRICS_JSONL). After a restart the trainers resume from the last checkpoint and re-run
the steps after it, so the same step can appear in several attempts: `merge_metrics` keeps the last attempt's record
of each step and writes `metrics.jsonl` with exactly one object per step, in step order.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from trainingrun.contract.rollout_state import DataAccount

# Fields every per-step record carries (contract: design.md, CLI `trainingrun run`).
REQUIRED_FIELDS = (
    "step",
    "rollout",
    "global_batch_size",
    "num_microbatches",
    "loss",
    "lr",
    "grad_norm",
    "samples_consumed",
    "tokens",
)

RAW_DIR = "raw"
_RAW_RE = re.compile(r"trainer-metrics\.attempt(\d+)\.jsonl$")


def raw_metrics_path(out_dir: Path, attempt: int) -> Path:
    return out_dir / RAW_DIR / f"trainer-metrics.attempt{attempt}.jsonl"


def raw_metrics_files(out_dir: Path) -> list[tuple[int, Path]]:
    """(attempt, path) of every raw metrics file under `out_dir`, oldest attempt first."""
    found = []
    for p in (out_dir / RAW_DIR).glob("trainer-metrics.attempt*.jsonl"):
        m = _RAW_RE.search(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete JSON objects of a raw file; a line cut short by a killed process is skipped."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def merge_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """One record per step over all attempts (the last attempt's record of a step wins), sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for attempt, path in raw_metrics_files(out_dir):
        for rec in read_records(path):
            rec.setdefault("attempt", attempt)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def write_metrics(out_dir: Path, records: list[dict[str, Any]]) -> Path:
    """Write `metrics.jsonl` (one JSON object per line, per step) atomically."""
    path = out_dir / "metrics.jsonl"
    tmp = path.with_name(".metrics.jsonl.tmp")
    try:
        with open(tmp, "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full volume: leave the old file, not half a new one
        raise
    return path


class LineTail:
    """Follows a file another process appends to: each call returns the complete lines written since the last one
    (`final=True` also returns a last line without its newline). `start` skips what is in the file already."""

    def __init__(self, path: Path, start: int = 0):
        self.path = path
        self._pos = start
        self._partial = b""

    def lines(self, final: bool = False) -> list[bytes]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._pos)
                data = fh.read()
        except OSError:
            return []
        self._pos += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return lines


class MetricsTail(LineTail):
    """Follows one raw metrics file as rank 0 appends to it; only complete lines are returned."""

    def poll(self) -> list[dict[str, Any]]:
        out = []
        for line in self.lines():
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if math.isfinite(v) else str(v)
    return "?" if v is None else str(v)


def summarize(
    records: list[dict[str, Any]],
    *,
    status: str,
    restarts: int,
    wall_seconds: float,
    tokens_this_run: float,
    attempts: list[dict[str, Any]],
    failure: dict[str, Any] | None,
    name: str,
    out_dir: Path,
    data: DataAccount | None = None,
) -> dict[str, Any]:
    """The content of summary.json. `data`: the rollout's account of the samples (`contract.rollout_state`:
    produced, filtered, published, and `leftover_groups`/`leftover_samples` that never filled a step)."""
    gbs = [r.get("global_batch_size") for r in records if isinstance(r.get("global_batch_size"), (int, float))]
    last = records[-1] if records else {}
    rewards = [float(r["reward_mean"]) for r in records if isinstance(r.get("reward_mean"), (int, float))]
    return {
        "run": name,
        "out_dir": str(out_dir),
        "status": status,
        "steps": len(records),
        "last_step": last.get("step"),
        "rollouts": (int(last["rollout"]) + 1) if isinstance(last.get("rollout"), int) else 0,
        "samples_consumed": last.get("samples_consumed", 0),
        "tokens": sum(float(r.get("tokens", 0) or 0) for r in records),
        "first_loss": records[0].get("loss") if records else None,
        "final_loss": last.get("loss"),
        "global_batch_size_min": min(gbs) if gbs else None,
        "global_batch_size_max": max(gbs) if gbs else None,
        # generated rollouts: mean reward of the first and last 5 steps' rollouts (all generated samples)
        "reward_first": sum(rewards[:5]) / len(rewards[:5]) if rewards else None,
        "reward_last": sum(rewards[-5:]) / len(rewards[-5:]) if rewards else None,
        "restarts": restarts,
        "wall_seconds": round(wall_seconds, 3),
        "tokens_per_second": (tokens_this_run / wall_seconds) if wall_seconds > 0 else None,
        "attempts": attempts,
        "exit_codes": attempts[-1]["exit_codes"] if attempts else {},
        "failure": failure,
        "data": None if data is None else data.to_json(),
    }


def summary_table(summary: dict[str, Any]) -> str:
    """A small human-readable table of the summary."""
    rows = [
        ("run", summary["run"]),
        ("status", summary["status"]),
        ("steps", summary["steps"]),
        ("rollouts", summary["rollouts"]),
        ("samples consumed", summary["samples_consumed"]),
        ("global batch size", f"{summary['global_batch_size_min']} .. {summary['global_batch_size_max']}"),
        ("loss first -> final", f"{_fmt(summary['first_loss'])} -> {_fmt(summary['final_loss'])}"),
        *([("reward first -> last", f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
                                    "(mean of the first/last 5 rollouts)")]
          if summary.get("reward_first") is not None else []),
        *_data_rows(summary.get("data")),
        ("restarts", summary["restarts"]),
        ("wall seconds", f"{summary['wall_seconds']:.1f}"),
        ("tokens/s", f"{summary['tokens_per_second']:.0f}" if summary["tokens_per_second"] is not None else "?"),
    ]
    for name, code in summary["exit_codes"].items():
        rows.append((f"exit {name}", "?" if code is None else code))
    rows.append(("output", summary["out_dir"]))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 30)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def _data_rows(data: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """Summary-table rows for the rollout's data report: what was produced, filtered, and left untrained."""
    if not data:
        return []
    f = data.get("samples_filtered", {})
    filtered = {"max_length": 0, "zero_variance": 0, **f}
    rows = [("samples produced", f"{data['samples_produced']} (filtered: "
                                 + ", ".join(f"{k} {v}" for k, v in filtered.items()) + ")")]
    if data.get("finished") and data.get("leftover_samples"):
        rows.append(("left over, not trained", f"{data['leftover_samples']} samples in {data['leftover_groups']} "
                                                f"group(s) (did not fill a step)"))
    return rows
