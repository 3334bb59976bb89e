"""`trainingrun plot`, `trainingrun status`, `trainingrun logs` and the run-directory lock, on run directories laid
out as the local launcher lays them out (raw per-attempt records, metrics.jsonl, pids.json, summary.json, logs/)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainingrun.cli import main as cli
from trainingrun.local.rundir import LOCK_FILE, RunDirBusy, RunDirLock, live_owner

ROOT = Path(__file__).resolve().parents[2]


def record(step: int, attempt: int, samples: int) -> dict:
    return {"step": step, "rollout": step - 1, "global_batch_size": 20 + (step * 7) % 13, "num_microbatches": 2,
            "loss": 6.0 / step, "lr": 1e-3 * step, "grad_norm": 1.0 + step / 10, "samples_consumed": samples,
            "tokens": 900, "reward": 0.1 * step, "samples_per_second": 30.0 + step, "tokens_per_second": 900.0 + step,
            "attempt": attempt}


def make_run_dir(d: Path, *, steps: int = 12, restart_at: int | None = 7, summary: str | None = "succeeded") -> list:
    """A run directory as the launcher leaves it; attempt 1 re-runs steps from `restart_at` (its checkpoint)."""
    (d / "raw").mkdir(parents=True)
    (d / "logs").mkdir()
    (d / "run.yaml").write_text("metadata: {name: plotted}\nspec: {rollout: {numRollouts: 12}}\n")
    samples, merged = 0, {}
    first = range(1, (restart_at + 2) if restart_at else steps + 1)
    with open(d / "raw" / "trainer-metrics.attempt0.jsonl", "w") as fh:
        for s in first:
            samples += 25
            rec = record(s, 0, samples)
            merged[s] = rec
            fh.write(json.dumps(rec) + "\n")
        fh.write('{"step": 99, "loss": 1.')  # a line cut short by a killed process
    if restart_at:
        samples = 25 * (restart_at - 1)
        with open(d / "raw" / "trainer-metrics.attempt1.jsonl", "w") as fh:
            for s in range(restart_at, steps + 1):
                samples += 25
                rec = record(s, 1, samples)
                merged[s] = rec
                fh.write(json.dumps(rec) + "\n")
    (d / "logs" / "rollout.log").write_text("r0 line 1\nr0 line 2\n")
    (d / "logs" / "trainer-0.log").write_text("t0 a0\n")
    (d / "logs" / "trainer-0.attempt1.log").write_text("t0 a1 first\nt0 a1 second\nt0 a1 third\n")
    (d / "logs" / "rollout.attempt1.log").write_text("r a1\n")
    (d / "logs" / "launcher.log").write_text("2026-11-30 10:00:00 attempt 0: started\n")
    (d / "pids.json").write_text(json.dumps({"launcher": 1, "attempt": 1 if restart_at else 0, "processes": {
        "rollout": {"pid": 2 ** 22 + 11, "log": "logs/rollout.attempt1.log"}}}))
    if summary:
        (d / "summary.json").write_text(json.dumps({"run": "plotted", "status": summary, "restarts": 1,
                                                    "wall_seconds": 12.5, "failure": None}))
    return [merged[s] for s in sorted(merged)]


# ------------------------------------------------------------------------------------------------------ plot
def test_plot_figure_shows_the_records_and_marks_the_restart(tmp_path):
    from trainingrun.local.history import restart_steps, step_records
    from trainingrun.local.plot import figure

    expected = make_run_dir(tmp_path)
    records = step_records(tmp_path)
    assert records == expected and restart_steps(records) == [(7, 1)]
    fig = figure(records, "plotted")
    axes = {a.get_title(): a for a in fig.axes if a.get_title()}
    assert set(axes) == {"loss", "global batch size per step", "learning rate vs samples consumed",
                         "gradient norm (before clipping)", "reward", "throughput"}
    loss = axes["loss"].get_lines()[0]
    assert list(loss.get_xdata()) == list(range(1, 13))
    assert list(loss.get_ydata()) == pytest.approx([6.0 / s for s in range(1, 13)])
    bars = [p.get_height() for p in axes["global batch size per step"].patches]
    assert bars == [r["global_batch_size"] for r in expected]
    lr = axes["learning rate vs samples consumed"].get_lines()[0]
    assert list(lr.get_xdata()) == [r["samples_consumed"] for r in expected]
    # the restart: a dashed vertical line just before step 7 on the per-step panels
    verticals = [ln for ln in axes["loss"].get_lines() if ln.get_linestyle() == "--"]
    assert [ln.get_xdata()[0] for ln in verticals] == [6.5]
    # samples/s and tokens/s on separate y axes
    twins = [a for a in fig.axes if a is not axes["throughput"] and a.bbox.bounds == axes["throughput"].bbox.bounds]
    assert len(twins) == 1 and twins[0].get_ylabel() == "tokens/s"


def write_evals(d: Path) -> list[dict]:
    """eval.jsonl as the rollout writes it (rollout.eval every 4 rollouts), one line cut short by a killed writer."""
    evals = [{"step": v, "weight_version": v, "rollout": v, "reward_mean": 0.1 + v / 20, "pass_at_1": v / 24,
              "pass_at_k": min(1.0, v / 10), "k": 4, "prompts": 16, "samples": 64, "response_length_mean": 3.0,
              "rewards_failed": 0, "seconds": 0.2, "time": 1.0} for v in (0, 4, 8, 12)]
    (d / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals) + '{"step": 1')
    return evals


def test_plot_draws_the_held_out_evaluations_in_the_reward_panel(tmp_path):
    from trainingrun.local.history import eval_records, step_records
    from trainingrun.local.plot import figure

    make_run_dir(tmp_path)
    evals = write_evals(tmp_path)
    assert [e.to_json() for e in eval_records(tmp_path)] == evals
    fig = figure(step_records(tmp_path), "plotted", eval_records(tmp_path))
    (reward,) = [a for a in fig.axes if a.get_title() == "reward"]
    lines = {ln.get_label(): ln for ln in reward.get_lines()}
    for label, key in (("held-out eval: reward mean", "reward_mean"), ("held-out eval: pass@1", "pass_at_1"),
                       ("held-out eval: pass@4", "pass_at_k")):
        assert list(lines[label].get_xdata()) == [0, 4, 8, 12]  # at the step the weights were trained to
        assert list(lines[label].get_ydata()) == pytest.approx([e[key] for e in evals])


def test_plot_command_writes_a_png_that_reads_back(tmp_path, capsys):
    import matplotlib.image

    make_run_dir(tmp_path)
    assert cli(["plot", str(tmp_path)]) == 0
    png = tmp_path / "plot.png"
    assert "wrote" in capsys.readouterr().out
    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (850, 1500)
    # not a blank canvas: many distinct colours (six panels of lines and bars)
    flat = img.reshape(-1, img.shape[2])[::97]
    assert len({tuple(px) for px in flat.round(2).tolist()}) > 30
    assert cli(["plot", str(tmp_path), "-o", str(tmp_path / "x" / "other.png")]) == 0
    assert (tmp_path / "x" / "other.png").stat().st_size > 10_000


def test_plot_reads_a_clusters_appended_metrics_jsonl(tmp_path):
    """A cluster's output directory: one metrics.jsonl appended by every attempt; the last record of a step wins."""
    from trainingrun.local.history import step_records

    lines = [record(1, 0, 10), record(2, 0, 20), record(3, 0, 30), record(2, 1, 20), record(3, 1, 30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [(r["step"], r["attempt"]) for r in step_records(tmp_path)] == [(1, 0), (2, 1), (3, 1)]


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert cli(["plot", str(tmp_path / "nope")]) == 1
    assert cli(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not a directory" in err[0] and "no step records" in err[1]
    make_run_dir(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an image with only the train extras
    assert cli(["plot", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.strip() == "error: trainingrun plot needs matplotlib: pip install 'trainingrun[local]'"


# ---------------------------------------------------------------------------------------------------- status
def test_status_of_a_finished_run(tmp_path, capsys):
    make_run_dir(tmp_path)
    assert cli(["status", str(tmp_path), "-o", "json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["phase"] == "Succeeded" and st["step"] == 12 and st["samples_consumed"] == 300
    assert st["rollout"] == 12 and st["num_rollouts"] == 12 and st["restarts"] == 1 and st["run"] == "plotted"
    assert st["processes"]["rollout"]["alive"] is False and st["launcher"] is None
    assert cli(["status", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "Succeeded" in table and "12/12" in table


def test_status_shows_the_last_evaluation(tmp_path, capsys):
    make_run_dir(tmp_path)
    assert cli(["status", str(tmp_path), "-o", "json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["eval"] is None and st["evaluations"] == 0
    evals = write_evals(tmp_path)
    assert cli(["status", str(tmp_path), "-o", "json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["eval"] == evals[-1] and st["evaluations"] == 4
    assert cli(["status", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    (row,) = [line for line in table.splitlines() if line.startswith("last evaluation")]
    assert row.split(None, 2)[2] == ("weight version 12 (step 12): reward mean 0.700, pass@1 0.500, pass@4 1.000 "
                                     "(4 evaluations, eval.jsonl)"), table


def test_status_phases(tmp_path, capsys):
    make_run_dir(tmp_path / "killed", summary=None)
    make_run_dir(tmp_path / "failed", summary="failed")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "run.yaml").write_text("metadata: {name: fresh}\n")
    phases = {}
    for name in ("killed", "failed", "fresh"):
        assert cli(["status", str(tmp_path / name), "-o", "json"]) == 0
        phases[name] = json.loads(capsys.readouterr().out)["phase"]
    assert phases == {"killed": "Stopped", "failed": "Failed", "fresh": "NotStarted"}
    (tmp_path / "empty").mkdir()
    assert cli(["status", str(tmp_path / "empty")]) == 1
    assert "not a run directory" in capsys.readouterr().err


def test_status_sees_a_live_launcher_through_the_lock(tmp_path, capsys):
    make_run_dir(tmp_path)
    pids = json.loads((tmp_path / "pids.json").read_text())
    (tmp_path / "pids.json").write_text(json.dumps({**pids, "attempt": 3, "first_attempt": 1}))
    with RunDirLock(tmp_path):
        assert cli(["status", str(tmp_path), "-o", "json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["phase"] == "Running" and st["launcher"]["pid"] == os.getpid()
        assert st["attempt"] == 3 and st["restarts"] == 2  # restarts of the live launcher: attempts 1 -> 3
    assert cli(["status", str(tmp_path), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["phase"] == "Succeeded"


# ------------------------------------------------------------------------------------------------------ lock
LOCK_HOLDER = """
import sys, time
from pathlib import Path
from trainingrun.local.rundir import RunDirLock
lock = RunDirLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_lock_refuses_a_second_owner_naming_the_first_and_frees_when_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy) as exc:
            RunDirLock(tmp_path).acquire()
        assert f"pid {holder.pid} on host" in str(exc.value) and "another `trainingrun run`" in str(exc.value)
        assert live_owner(tmp_path)["pid"] == holder.pid
    finally:
        holder.kill()  # SIGKILL: no clean-up; the kernel drops the flock
        holder.wait()
    assert live_owner(tmp_path) is None
    with RunDirLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirBusy):  # also refused within one process (a second open file description)
            RunDirLock(tmp_path).acquire()
        assert lock._fd is not None


# ------------------------------------------------------------------------------------------------------ logs
def test_logs_of_the_newest_attempt_one_process_and_tail(tmp_path, capsys):
    make_run_dir(tmp_path)
    assert cli(["logs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[trainer-0] t0 a1 first" in out and "[rollout] r a1" in out and not any("a0" in ln for ln in out)
    assert any(ln.startswith("[launcher] ") for ln in out)
    assert cli(["logs", str(tmp_path), "trainer-0", "--tail", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == ["t0 a1 second", "t0 a1 third"]
    assert cli(["logs", str(tmp_path), "rollout", "--attempt", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["r0 line 1", "r0 line 2"]
    assert cli(["logs", str(tmp_path), "trainer-7"]) == 1
    assert "trainer-7: no such process in attempt 1" in capsys.readouterr().err


def test_logs_follow_prints_new_lines_until_the_launcher_exits(tmp_path):
    make_run_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        follow = subprocess.Popen([sys.executable, "-m", "trainingrun", "logs", str(tmp_path), "trainer-0", "-f"],
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert follow.stdout.readline().strip() == "t0 a1 first"
        time.sleep(0.5)
        with open(tmp_path / "logs" / "trainer-0.attempt1.log", "a") as fh:
            fh.write("appended while following\n")
        lines = [follow.stdout.readline().strip() for _ in range(3)]
        assert lines[-1] == "appended while following"
        # a restart: the follower switches to the new attempt's log
        (tmp_path / "logs" / "trainer-0.attempt2.log").write_text("t0 a2 hello\n")
        assert follow.stdout.readline().strip() == "t0 a2 hello"
        assert follow.poll() is None
    finally:
        holder.kill()
        holder.wait()
    assert follow.wait(timeout=20) == 0
