"""A local run's pool of real vLLM CPU servers resized while it runs (issue 32 item 4, acceptance for the local
launcher): `trainingrun scale RUN_DIR --replicas 2`, then `--replicas 1`, on a running `trainingrun run` with real
Megatron-core trainers, the tiny Llama (fp32) and weight sync by `disk` at lag 0.

The trainer is held (SIGSTOP) while engine-1 starts (a minute or more on this CPU; the run takes seconds a rollout),
so that the later rollouts use both servers. Checked: the run succeeds with one attempt and no restart (the trainer
and the rollout keep their processes); every rollout is generated exactly once (samples_produced = rollouts x
samplesPerRollout) and at lag 0 with exactly the trainer's weights (logprob_abs_diff within the fp32 tolerance on
every step, engine-1's included); engine-1 loaded the current version before its first request and served some;
after the scale-down it is stopped while the run goes on, and gets no request after the rollout's pool let it go.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_vllm_e2e import FP32_TOL, check_on_policy, parity_reward, signal_group, write_spec  # noqa: F401
from tests.localrun import finish, start
from tests.services import pid_alive, wait_for

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(1500)]

ROLLOUTS = 12


def scale(out: Path, replicas: int, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainingrun", "scale", str(out), "--replicas", str(replicas),
                           "--wait", "--timeout", str(timeout)], capture_output=True, text=True, timeout=timeout + 60)


def test_a_local_pool_resized_1_to_2_to_1_while_the_run_goes_on(tmp_path: Path, tiny_llama_dir: Path):
    out = tmp_path / "run"
    proc = start(write_spec(tmp_path / "scale.yaml", tiny_llama_dir, sync="disk", dtype="float32", rollouts=ROLLOUTS),
                 out)
    try:
        wait_for(lambda: proc.poll() is not None or any(p.stat().st_size for p in (out / "raw").glob("*.jsonl")),
                 900, "the first step")
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        before = json.loads((out / "pids.json").read_text())
        processes = before["processes"]
        assert before["engine_replicas"] == {"wanted": 1, "listed": 1, "leaving": 0}, before
        trainer = processes["trainer-0"]["pid"]
        signal_group(trainer, signal.SIGSTOP)  # hold the run while engine-1 starts
        try:
            up = scale(out, 2)
        finally:
            signal_group(trainer, signal.SIGCONT)
        assert up.returncode == 0, up.stdout + up.stderr
        grown = json.loads((out / "pids.json").read_text())["processes"]
        assert {"engine-0", "engine-1"} <= set(grown) and grown["engine-1"]["listed"], grown
        engine1, log1 = grown["engine-1"]["pid"], out / "logs" / "engine-1.log"
        wait_for(lambda: proc.poll() is not None or "/v1/completions" in log1.read_text(), 300, "engine-1 serving")
        assert proc.poll() is None, "the run ended before engine-1 served"
        down = scale(out, 1)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not pid_alive(engine1), "engine-1 still runs after the scale-down"
        served_when_stopped = log1.read_text().count("/v1/completions")
        after = json.loads((out / "pids.json").read_text())
        assert set(after["processes"]) == {"rollout", "trainer-0", "engine-0"}, after
        assert proc.poll() is None, "the run ended before the scale-down completed: too few rollouts to see it"
    except BaseException:
        proc.kill()
        raise
    code, log = finish(proc, timeout=1200)
    assert code == 0, log[-6000:]
    recs = check_on_policy(out, log, FP32_TOL, ROLLOUTS)  # every prompt once; every step on the trainer's weights
    print("scale: logprob_abs_diff", [r["logprob_abs_diff"] for r in recs])
    summary = json.loads((out / "summary.json").read_text())
    # the trainer and the rollout never restarted: one attempt, the same processes throughout
    assert summary["restarts"] == 0 and [a["attempt"] for a in summary["attempts"]] == [0], summary["attempts"]
    pids = summary["attempts"][0]["pids"]
    assert pids["trainer-0"] == processes["trainer-0"]["pid"] and pids["rollout"] == processes["rollout"]["pid"], pids
    resizes = summary["engine_resizes"]
    assert [(r["from"], r["to"]) for r in resizes] == [(1, 2), (2, 1)] and all(r["reached_after"] for r in resizes)
    print("scale: reached after", [r["reached_after"] for r in resizes], "s")
    # engine-1 was loaded with the current version before its first request, and nothing reached it once let go
    text = log1.read_text()
    assert text.index("/collective_rpc") < text.index("/v1/completions"), text[-3000:]
    assert text.count("/v1/completions") == served_when_stopped
    rollout_log = (out / "logs" / "rollout.log").read_text()
    assert "resized from 1 to 2 server(s)" in rollout_log and "resized from 2 to 1 server(s)" in rollout_log
    assert "Traceback" not in rollout_log, rollout_log[-4000:]  # the join of engine-1 ran clean (regression)
    # once let go, engine-1 was never probed, loaded, taken out or retried by the rollout's pool
    after = rollout_log.split("resized from 2 to 1 server(s)", 1)[1].split("\n", 1)[1]
    assert "engine-1" not in after, after[-3000:]
