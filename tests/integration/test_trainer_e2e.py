"""`trainingrun trainer` end to end on a real file store, 2 ranks over gloo (Megatron in subprocesses).

One scenario, five launches of the 2-rank group:
  A. uninterrupted: 3 rollouts (sample counts vary, so steps per rollout vary) → metrics JSONL;
  B1. a second store gets the same rollouts 0 and 1 only; the group trains them, checkpoints, and gives up waiting
      for rollout 2 (exit non-zero, as a crashed group would);
  B2. rollout 2 is published, the group restarts (attempt 1). A half-written checkpoint directory newer than the
      newest complete one is planted and must be ignored; the newest complete one has a truncated shard, so the
      group falls back to the previous complete checkpoint (naming the path and why) and finishes;
  C. every checkpoint damaged: exit 78 naming each path, no traceback;
  D. a trainer of an older attempt than the one recorded with the checkpoints: refused, exit 78.
Checks: the JSONL records (fields, cumulative samples, the LR scheduler's consumed samples = samples consumed, every
step trained once with the scheduled global batch), and that B's per-step loss equals A's (≤1e-5 relative) with the
same final samples_consumed and the same sample ids per step (nothing trained twice or skipped).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.services import metrics_ports, rendezvous_port

CONFIG = """\
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {name: e2e}
spec:
  seed: 7
  model: {numLayers: 2, hiddenSize: 32, numAttentionHeads: 4, vocabSize: 32, seqLength: 64}
  trainer:
    replicas: 2
    maxTokensPerGPU: 48
    lossType: sft
    lossNormalization: token
    optimizer: {lr: 0.003, minLr: 0.0003, warmupSamples: 6, decaySamples: 60}
    checkpoint: {interval: 2, path: ckpt, keep: 2}
"""
COUNTS = [12, 8, 16]  # samples per rollout; groups of 2, 2 groups per step -> 3, 2, 4 steps
REQUIRED = ("step", "rollout", "global_batch_size", "num_microbatches", "loss", "lr", "grad_norm", "samples_consumed",
            "tokens", "attempt", "step_seconds", "samples_per_second", "tokens_per_second",
            "scheduler_consumed_samples")


def _publish(url: str, rollouts: range, finish: bool) -> None:
    from trainingrun.contract import published
    from trainingrun.store import open_store
    from tests.synthetic import make_samples, schedule_and_payloads

    store = open_store(url)
    step_offset = samples_offset = 0
    for k in range(max(rollouts) + 1):
        s = make_samples(COUNTS[k], vocab=32, seed=100 + k, group_size=2, id_base=k * 1000)
        rollout, payloads = schedule_and_payloads(s, dp_size=2, rollout=k, step_offset=step_offset,
                                                  samples_offset=samples_offset, groups_per_step=2,
                                                  max_tokens_per_gpu=48)
        if k in rollouts:
            published.publish(store, rollout, payloads)
        step_offset += rollout.num_steps
        samples_offset += rollout.num_samples
    if finish:
        store.finish(len(COUNTS))


def _launch(rundir: Path, store_url: str, attempt: int, extra_args: list[str] = ()) -> list[tuple[int, str]]:
    port = rendezvous_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TRAININGRUN_CONFIG": str(rundir / "run.yaml"), "TRAININGRUN_STORE_URL": store_url,
           "TRAININGRUN_RUN": "e2e", "TRAININGRUN_ATTEMPT": str(attempt), "OMP_NUM_THREADS": "1",
           "TRAININGRUN_METRICS_JSONL": str(rundir / "metrics.jsonl"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-m", "trainingrun", "trainer", *extra_args], cwd=rundir,
                              env={**env, "RANK": str(r), "TRAININGRUN_METRICS_PORT": str(metrics_ports(1))},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    return [(p.wait(timeout=240), p.stdout.read()) for p in procs]


def _records(rundir: Path) -> list[dict]:
    return [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.megatron
def test_trainer_end_to_end_and_exact_resume(tmp_path: Path) -> None:
    # ---- A: uninterrupted
    a = tmp_path / "a"
    a.mkdir()
    (a / "run.yaml").write_text(CONFIG)
    _publish(f"file://{a}/store", range(3), finish=True)
    results = _launch(a, f"file://{a}/store", attempt=0)
    for rc, out in results:
        assert rc == 0, out[-3000:]
    rec_a = _records(a)
    assert [r["step"] for r in rec_a] == list(range(1, 10))
    assert [r["rollout"] for r in rec_a] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    for r in rec_a:
        missing = [f for f in REQUIRED if f not in r]
        assert not missing, missing
        assert r["scheduler_consumed_samples"] == r["samples_consumed"]  # LR schedule counted in samples
        assert r["samples_trained"] == r["global_batch_size"]
    assert [r["samples_consumed"] for r in rec_a] == list(__import__("itertools").accumulate(
        r["global_batch_size"] for r in rec_a))
    assert rec_a[-1]["samples_consumed"] == sum(COUNTS)
    assert rec_a[0]["lr"] < rec_a[1]["lr"]  # warmup over samples
    # keep: 2 (the checkpoint root also holds the fence and the TensorBoard events, trainingrun/tracking.py)
    assert sorted(p.name for p in (a / "ckpt").glob("step_*")) == ["step_00000008", "step_00000009"]
    # the progress rank 0 leaves in the store is what the operator turns into the TrainingRun's status
    from trainingrun.api import parse_trainingrun
    from trainingrun.operator.observe import Observed, ProgressObs
    from trainingrun.operator.status import decide
    from trainingrun.store import open_store

    progress = open_store(f"file://{a}/store").get_json("progress")
    run = parse_trainingrun(yaml.safe_load(CONFIG))
    status = decide(run, None, Observed(progress=ProgressObs(value=progress)),
                    now=dt.datetime.now(dt.timezone.utc)).status
    assert (status["step"], status["samplesConsumed"], status["lastGlobalBatchSize"], status["rollout"]) == (
        9, rec_a[-1]["samples_consumed"], rec_a[-1]["global_batch_size"], rec_a[-1]["rollout"])

    # ---- B1: only rollouts 0 and 1 available; the group gives up waiting for rollout 2
    b = tmp_path / "b"
    b.mkdir()
    (b / "run.yaml").write_text(CONFIG)
    _publish(f"file://{b}/store", range(2), finish=False)
    results = _launch(b, f"file://{b}/store", attempt=0, extra_args=["--wait-timeout", "2"])
    assert all(rc != 0 for rc, _ in results)
    done_b1 = _records(b)
    assert [r["step"] for r in done_b1] == [1, 2, 3, 4, 5]
    ckpts = sorted(p.name for p in (b / "ckpt").glob("step_*"))
    assert ckpts == ["step_00000002", "step_00000004"], ckpts
    # a newer but incomplete checkpoint (no COMPLETE marker, garbage inside) must never be loaded
    bad = b / "ckpt" / "step_00000005"
    bad.mkdir()
    (bad / "progress.json").write_text(json.dumps({"global_step": 5, "rollout": 2, "step_in_rollout": 0,
                                                   "samples_consumed": 20}))
    (bad / "dist").mkdir()
    (bad / "dist" / "__0_0.distcp").write_bytes(b"half-written")
    # and the newest complete one has a truncated shard (its COMPLETE marker is there): attempt 1 must fall back to
    # step 2, whose data (rollout 0) the store still holds (it releases only what every kept checkpoint covers)
    shard = max((b / "ckpt" / "step_00000004" / "dist").glob("__*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 3])

    # ---- B2: the rest arrives, attempt 1 resumes from step 2 (rollout 0, step 2 within it)
    _publish(f"file://{b}/store", range(2, 3), finish=True)
    results = _launch(b, f"file://{b}/store", attempt=1)
    for rc, out in results:
        assert rc == 0, out[-3000:]
    log0 = results[0][1]
    assert (f"checkpoint ckpt/step_00000004 cannot be loaded: dist/{shard.name} has {size // 3} bytes, {size} were "
            "written (truncated or replaced)") in log0, log0[-3000:]
    assert "resumed from ckpt/step_00000002" in log0
    assert (b / "ckpt" / "step_00000004.unloadable-a1").is_dir()
    rec_b = _records(b)
    resumed = [r for r in rec_b if r["attempt"] == 1]
    assert [r["step"] for r in resumed] == [3, 4, 5, 6, 7, 8, 9]
    final = {r["step"]: r for r in rec_b}  # the last attempt's record of each step wins
    assert sorted(final) == list(range(1, 10))
    for step in range(1, 10):
        ra, rb = rec_a[step - 1], final[step]
        assert rb["global_batch_size"] == ra["global_batch_size"]
        assert rb["sample_id_sum"] == ra["sample_id_sum"]  # the same samples in each step
        assert rb["lr"] == pytest.approx(ra["lr"], rel=1e-12)
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), step
    assert final[9]["samples_consumed"] == rec_a[-1]["samples_consumed"]
    # every sample id of every rollout trained exactly once: Σ ids over steps = Σ of all published ids
    all_ids = sum(k * 1000 * n + n * (n - 1) // 2 for k, n in enumerate(COUNTS))
    assert sum(final[s]["sample_id_sum"] for s in final) == all_ids

    # ---- C: every checkpoint damaged: attempt 2 fails once with exit 78 (a configuration/data error, not retried)
    # naming each path and why, instead of a traceback that a restart would repeat
    for d in sorted((b / "ckpt").glob("step_0*")):
        for f in (d / "dist").glob("__*.distcp"):
            f.write_bytes(f.read_bytes()[:10])
    results = _launch(b, f"file://{b}/store", attempt=2)
    assert [rc for rc, _ in results] == [78, 78], results[0][1][-3000:]
    assert "no checkpoint in" in results[0][1] and "step_00000009: dist/__" in results[0][1]
    assert "step_00000008: dist/__" in results[0][1] and "Traceback" not in results[0][1]

    # ---- D: a trainer of an older attempt (a zombie: attempt 2 has resumed here since) is refused, exit 78
    results = _launch(b, f"file://{b}/store", attempt=1)
    assert [rc for rc, _ in results] == [78, 78], results[0][1][-3000:]
    # the store fences the zombie off first (it opens the store before it looks at the checkpoints); either way the
    # message names both attempts
    assert ("attempt 1 may not resume: attempt 2 has resumed from them since" in results[0][1]
            or "belongs to attempt 1, but the store's current attempt is 2" in results[0][1]), results[0][1][-3000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
