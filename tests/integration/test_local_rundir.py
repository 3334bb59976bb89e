"""What `trainingrun run` does with its run directory, and what it shows while it runs — with the fast stand-in
children of test_local_launcher.py (the launcher itself is real): the run-directory lock, changed specs, --resume and
--fresh, directories that are not run directories, the default checkpoint path, the plot a finished run writes,
`trainingrun status` of a live run, and the live progress line on an 80-column pseudo-terminal."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import yaml

from tests.integration.test_local_launcher import ROOT, fake, finish, launch, make_spec, read_metrics  # noqa: F401
from tests.services import wait_for
from tests.unit.test_progress import Pty, screen_lines


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_second_run_on_a_live_directory_is_refused_at_once_naming_the_owner(tmp_path, fake):
    out = tmp_path / "run"
    spec = make_spec(tmp_path)
    first = launch(spec, out, fake, mode="sleep")
    try:
        wait_for(lambda: (out / "pids.json").exists(), 30, "the first launcher's processes")
        t0 = time.monotonic()
        code, _, stderr = finish(launch(spec, out, fake), timeout=30)
        assert code == 1 and time.monotonic() - t0 < 15
        assert f"is in use by another `trainingrun run`: pid {first.pid} on host" in stderr
        assert len(stderr.strip().splitlines()) == 1
        # the second launcher changed nothing: the first one's processes are still the ones in pids.json
        assert not list((out / "logs").glob("*.attempt1.log"))
        status = subprocess.run([sys.executable, "-m", "trainingrun", "status", str(out), "-o", "json"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        st = json.loads(status.stdout)
        assert st["phase"] == "Running" and st["launcher"]["pid"] == first.pid
        assert all(p["alive"] for p in st["processes"].values())
    finally:
        stop(first)
    # once the first launcher is gone, the directory is free again (kernel-released lock, no stale file to remove)
    code, _, stderr = finish(launch(spec, out, fake), timeout=60)
    assert code == 0, stderr


def test_changed_spec_is_refused_with_the_difference_then_resume_or_fresh(tmp_path, fake):
    out = tmp_path / "run"
    spec = make_spec(tmp_path)
    assert finish(launch(spec, out, fake))[0] == 0
    before = read_metrics(out)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["trainer"]["optimizer"]["lr"] = 0.001
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(doc))

    code, _, stderr = finish(launch(changed, out, fake))
    assert code == 1 and "holds an earlier run of a different spec" in stderr and "--fresh" in stderr
    assert "-      lr: 0.003" in stderr and "+      lr: 0.001" in stderr
    assert read_metrics(out) == before and "lr: 0.003" in (out / "run.yaml").read_text()

    code, _, stderr = finish(launch(changed, out, fake, "--resume"))  # explicit: continue with the new spec
    assert code == 0, stderr
    assert "lr: 0.001" in (out / "run.yaml").read_text()
    assert (out / "logs" / "trainer-0.attempt1.log").exists()

    code, stdout, stderr = finish(launch(spec, out, fake, "--fresh"))
    assert code == 0, stderr
    assert "--fresh: removed the earlier run" in stdout
    assert not list((out / "logs").glob("*.attempt*.log")), "attempts start again at 0"
    assert json.loads((out / "summary.json").read_text())["first_attempt"] == 0
    assert [r["attempt"] for r in read_metrics(out)] == [0] * 12

    code, _, stderr = finish(launch(spec, tmp_path / "nothing-here", fake, "--resume"))
    assert code == 1 and "no earlier run to resume" in stderr
    code, _, stderr = finish(launch(spec, out, fake, "--resume", "--fresh"))
    assert code == 2 and "not allowed with argument" in stderr


def test_another_trainers_count_resumes_without_resume_but_other_changes_do_not(tmp_path, fake):
    """Rerunning with another --trainers is a resize (elastic data parallelism): it continues the run as it is, so it
    needs no --resume (issue: it used to exit 78); the same resize with any other change is still refused."""
    out = tmp_path / "run"
    spec = make_spec(tmp_path)
    assert finish(launch(spec, out, fake, "--trainers", "2"))[0] == 0
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["trainer"]["optimizer"]["lr"] = 0.001
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(doc))
    code, _, stderr = finish(launch(changed, out, fake, "--trainers", "3"))
    assert code == 1 and "holds an earlier run of a different spec" in stderr and "+      lr: 0.001" in stderr
    code, stdout, stderr = finish(launch(spec, out, fake, "--trainers", "3"))
    assert code == 0, stderr
    assert "resizing the run in" in stdout and "2 -> 3 trainer(s)" in stdout
    assert "replicas: 3" in (out / "run.yaml").read_text()


def test_out_that_is_a_file_or_a_foreign_directory_is_refused(tmp_path, fake):
    spec = make_spec(tmp_path)
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    code, stdout, stderr = finish(launch(spec, afile, fake))
    assert code == 1 and stderr.strip() == f"error: --out {afile}: is a file, not a directory"
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    for extra in ((), ("--fresh",)):
        code, _, stderr = finish(launch(spec, foreign, fake, *extra))
        assert code == 1 and "is not empty and is not a run directory" in stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["cat.jpg"]


def test_default_checkpoint_path_is_inside_the_run_directory_and_the_run_writes_its_plot(tmp_path, fake):
    import matplotlib.image

    doc = yaml.safe_load(make_spec(tmp_path).read_text())
    del doc["spec"]["trainer"]["checkpoint"]["path"]
    spec = tmp_path / "nopath.yaml"
    spec.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(spec, out, fake, plot=True))
    assert code == 0, stderr
    assert yaml.safe_load((out / "run.yaml").read_text())["spec"]["trainer"]["checkpoint"]["path"] == "checkpoints"
    assert matplotlib.image.imread(out / "plot.png").shape[:2] == (850, 1500)
    assert f"plot: {out / 'plot.png'}" in stdout
    # every launcher line on stdout and in logs/launcher.log starts with the time
    events = [ln for ln in stdout.splitlines() if "attempt 0: started" in ln]
    assert events and re.match(r"\d\d:\d\d:\d\d attempt 0: started", events[0])
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d attempt 0: started", (out / "logs" / "launcher.log").read_text(),
                     re.M)


def test_no_plot_leaves_the_plot_to_trainingrun_plot(tmp_path, fake):
    out = tmp_path / "run"
    code, stdout, stderr = finish(launch(make_spec(tmp_path), out, fake))  # launch's default: --no-plot
    assert code == 0, stderr
    assert (out / "metrics.jsonl").exists() and not (out / "plot.png").exists()
    assert "plot:" not in stdout


def test_progress_line_fits_an_80_column_terminal(tmp_path, fake):
    """The real launcher on a pseudo-terminal 80 columns wide: no drawn line is wider, and the line shows the start,
    the steps, elapsed<remaining; plain timestamped lines for events."""
    out = tmp_path / "a-rather-long-run-directory-name-to-make-the-event-lines-long" / "run"
    term = Pty(80)
    env = {**os.environ, "TRAININGRUN_CHILD_COMMAND": shlex.join([sys.executable, str(fake)]), "FAKE_MODE": "ok",
           "FAKE_STEP_SECONDS": "0.25", "FAKE_STEPS": "12", "COLUMNS": "80", "TERM": "xterm"}
    env.pop("LINES", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainingrun", "run", str(make_spec(tmp_path)), "--out", str(out),
                             "--grace-seconds", "1"], cwd=ROOT, env=env, stdin=term.slave, stdout=term.slave,
                            stderr=subprocess.PIPE, text=True)
    raw = ""
    try:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            raw += term.read()
            time.sleep(0.05)
        raw += term.read()
        assert proc.wait(10) == 0, proc.stderr.read()
    finally:
        stop(proc)
        term.close()
    lines = [ln for ln in screen_lines(raw) if ln.strip()]
    bars = [ln for ln in lines if re.match(r"rollout \d+/\d+ ", ln)]
    assert bars, raw[-2000:]
    widest = max(bars, key=len)
    assert len(widest.rstrip()) <= 80, widest
    assert any("starting: loading torch" in ln for ln in bars)
    assert any("step 11" in ln and re.search(r"\d\d:\d\d<", ln) for ln in bars)
    assert "\r" in raw  # redrawn in place
    # redrawn when something changed, not 5 times a second: at most ~2 draws per step or elapsed second
    assert len(bars) <= 3 * 12 + 30


def test_set_overrides_are_validated_like_the_file(tmp_path, fake):
    spec = make_spec(tmp_path)
    out = tmp_path / "run"
    code, _, stderr = finish(launch(spec, out, fake, "--set", "trainer.optimizer.lr=1e-3", "--set",
                                    "rollout.numRollouts=5", "--set", "metadata.name=renamed"))
    assert code == 0, stderr
    doc = yaml.safe_load((out / "run.yaml").read_text())
    assert doc["spec"]["trainer"]["optimizer"]["lr"] == 0.001 and doc["spec"]["rollout"]["numRollouts"] == 5
    assert doc["metadata"]["name"] == "renamed"
    for bad, message in ((["--set", "rollout.numRollouts=eight"],
                          '--set spec.rollout.numRollouts: spec.rollout.numRollouts: invalid value "eight"'),
                         (["--set", "trainer.optimizer.bogus=1"], "spec.trainer.optimizer.bogus: unknown field"),
                         (["--set", "nothing"], "--set nothing: expected PATH=VALUE"),
                         (["--set", "trainer.optimizer.lr=1e-5"], "minLr must be <= lr")):
        fresh = tmp_path / f"bad{len(message)}"
        code, _, stderr = finish(launch(spec, fresh, fake, *bad))
        assert code == 1 and message in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1 and not fresh.exists()
