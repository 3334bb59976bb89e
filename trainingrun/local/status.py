"""`trainingrun status RUN_DIR [-o json]`: where a local run stands, live or finished.

Phase: Running while a launcher holds the run directory's lock (`trainingrun.local.rundir`); otherwise the status of the
last summary.json (Succeeded, Failed, Interrupted); Stopped when steps were trained but the launcher ended without a
summary (killed); NotStarted when the directory has neither. Step, rollout, samples, loss and global batch size come
from the newest step record (also while the run is live); with `rollout.eval` the last evaluation on held-out prompts
and their count from eval.jsonl; attempt and processes from pids.json; restarts from
summary.json, or while live from the attempts seen. The columns are the fields of `-o json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from trainingrun.local.history import eval_records, step_records
from trainingrun.local.rundir import live_owner

PHASES = {"succeeded": "Succeeded", "failed": "Failed", "interrupted": "Interrupted"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory of `trainingrun run` (e.g. runs/tiny)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_status(run_dir: Path) -> dict[str, Any]:
    """The status object (`-o json`)."""
    owner = live_owner(run_dir)
    summary = _read_json(run_dir / "summary.json")
    pids = _read_json(run_dir / "pids.json") or {}
    records = step_records(run_dir)
    last = records[-1] if records else {}
    evals = eval_records(run_dir)
    try:
        doc = yaml.safe_load((run_dir / "run.yaml").read_text())
    except (OSError, yaml.YAMLError):
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    num_rollouts = ((doc.get("spec") or {}).get("rollout") or {}).get("numRollouts")
    name = (doc.get("metadata") or {}).get("name") or (summary or {}).get("run") or run_dir.resolve().name
    if owner is not None:
        phase = "Running"
    elif summary is not None and summary.get("status") in PHASES:
        phase = PHASES[summary["status"]]
    elif records:
        phase = "Stopped"
    else:
        phase = "NotStarted"
    attempts = sorted({r.get("attempt") for r in records if isinstance(r.get("attempt"), int)})
    if owner is None and summary is not None:
        restarts = summary.get("restarts", 0)
    else:  # live, or killed without a summary: the attempts the last launcher started (pids.json)
        first = pids.get("first_attempt")
        first = first if isinstance(first, int) else (attempts[0] if attempts else 0)
        attempt = pids.get("attempt")
        restarts = max(0, attempt - first) if isinstance(attempt, int) else 0
    processes = {}
    for pname, p in (pids.get("processes") or {}).items():
        processes[pname] = {"pid": p.get("pid"), "alive": phase == "Running" and _alive(p.get("pid")),
                            "log": p.get("log")}
    return {
        "run": name,
        "run_dir": str(run_dir),
        "phase": phase,
        "launcher": owner,
        "attempt": pids.get("attempt"),
        "restarts": restarts,
        "step": last.get("step", 0),
        "rollout": (int(last["rollout"]) + 1) if isinstance(last.get("rollout"), int) else 0,
        "num_rollouts": num_rollouts,
        "samples_consumed": last.get("samples_consumed", 0),
        "global_batch_size": last.get("global_batch_size"),
        "loss": last.get("loss"),
        "evaluations": len(evals),
        "eval": evals[-1].to_json() if evals else None,
        "processes": processes,
        "failure": (summary or {}).get("failure") if owner is None else None,
        "wall_seconds": (summary or {}).get("wall_seconds") if owner is None else None,
    }


def format_status(st: dict[str, Any]) -> str:
    loss = st["loss"]
    rollouts = f"{st['rollout']}/{st['num_rollouts']}" if st["num_rollouts"] else str(st["rollout"])
    rows = [
        ("run", st["run"]),
        ("phase", st["phase"]),
        ("step", st["step"]),
        ("rollouts", rollouts),
        ("samples", st["samples_consumed"]),
        ("last global batch size", "-" if st["global_batch_size"] is None else st["global_batch_size"]),
        ("last loss", "-" if loss is None else (f"{loss:.4f}" if isinstance(loss, float) else loss)),
        ("attempt", "-" if st["attempt"] is None else st["attempt"]),
        ("restarts", st["restarts"]),
    ]
    if st["eval"]:
        e = st["eval"]
        rows.append(("last evaluation", f"weight version {e['weight_version']} (step {e['step']}): reward mean "
                                        f"{e['reward_mean']:.3f}, pass@1 {e['pass_at_1']:.3f}, pass@{e['k']} "
                                        f"{e['pass_at_k']:.3f} ({st['evaluations']} evaluations, eval.jsonl)"))
    if st["launcher"]:
        rows.append(("launcher", f"pid {st['launcher'].get('pid')} on {st['launcher'].get('host')}"))
    for name, p in st["processes"].items():
        state = "running" if p["alive"] else "exited"
        rows.append((name, f"pid {p['pid']} {state}"))
    if st["failure"]:
        f = st["failure"]
        rows.append(("failure", f"{f.get('process')}: {f.get('reason')}"))
    if st["wall_seconds"] is not None:
        rows.append(("wall seconds", f"{st['wall_seconds']:.1f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir}: not a directory", file=sys.stderr)
        return 1
    if not any((run_dir / f).exists() for f in ("run.yaml", "summary.json", "pids.json", "metrics.jsonl")):
        print(f"error: {run_dir}: not a run directory (no run.yaml, summary.json, pids.json or metrics.jsonl)",
              file=sys.stderr)
        return 1
    st = run_status(run_dir)
    if args.output == "json":
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(format_status(st))
    return 0
