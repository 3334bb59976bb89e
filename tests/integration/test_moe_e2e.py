"""Expert parallelism end to end: a small random Qwen3-MoE saved by transformers, trained by `trainingrun run` on CPU
(gloo), 2 trainer ranks, with the variable global batch (zero-variance filter + dynamic steps) and uneven
data-parallel ranks (variable-length samples).

* EP 2 vs EP 1: the same per-step losses (≤ 1e-5 relative), gradient norms (≤ 1e-5 relative) and router statistics
  (tokens per expert, load imbalance). The EP 2 run's routers really route over two expert ranks (all-gather
  dispatcher, micro-batches padded to equal lengths within the group).
* `trainingrun export-hf` of the EP 2 checkpoint (experts gathered from both ranks) loads in transformers as
  `qwen3_moe` and scores as the checkpoint does (≤ 1e-4).
* The EP 2 run, stopped after its first checkpoint and resumed at EP 1, continues as if nothing changed: every step
  equals the EP 1 run's. Before the expert parameters were marked expert-parallel at EP 1 too
  (`modeling.moe.mark_expert_params`), the EP 2 checkpoint's optimizer keys (`chained_0.…`) did not load at EP 1
  (KeyError in dist_checkpointing, every restart).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import localrun
from tests.integration.test_hf_architectures import make_model
from tests.integration.test_hf_models import LINES, TOL, hf_logprobs, max_diff, score
from tests.integration.test_local_e2e import assert_same_run, first_checkpoint
from tests.localrun import finish, records, start

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


def _spec(path: Path, hf: Path) -> Path:
    path.write_text(f"""
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {{name: moe}}
spec:
  seed: 5
  model: {{hf: {hf}, seqLength: 64}}
  trainer:
    replicas: 2
    maxTokensPerGPU: 256
    lossNormalization: sample
    optimizer: {{lr: 0.003, clipGrad: 0.0}}
    checkpoint: {{interval: 2, path: checkpoints}}
  rollout:
    source: {{type: synthetic, synthetic: {{task: reverse, minLength: 4, maxLength: 12, vocabSize: 16}}}}
    samplesPerRollout: 32
    groupSize: 4
    filters: {{zeroVariance: true}}
    steps: {{policy: dynamic}}
    numRollouts: 4
  metrics: {{enabled: false}}
""")
    return path


@pytest.mark.megatron
def test_ep2_trains_like_ep1_exports_and_resumes_at_ep1(tmp_path: Path) -> None:
    hf = make_model("qwen3_moe", tmp_path / "hf")
    spec = _spec(tmp_path / "moe.yaml", hf)

    ref_out = tmp_path / "ep1"
    code, log = finish(start(spec, ref_out))
    assert code == 0, log[-4000:]
    ref = records(ref_out)
    assert len(ref) == 4 and len({r["global_batch_size"] for r in ref}) > 1, ref  # the variable global batch
    assert all(r["moe_load_imbalance"] >= 1.0 and r["moe_tokens_per_expert"] > 0 for r in ref)

    out = tmp_path / "ep2"
    code, log = localrun.stop_held(start(spec, out, "--set", "trainer.expertParallelSize=2"), out,
                                   lambda: first_checkpoint(out), "its first checkpoint")
    assert code == 143, log[-3000:]
    ep2 = records(out)
    assert len(ep2) >= 2, ep2
    assert any(", ep 2" in f.read_text() for f in (out / "logs").glob("trainer-0*.log"))
    for got, want in zip(ep2, ref):
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
        for key in ("global_batch_size", "moe_tokens_per_expert", "moe_tokens_per_expert_max", "moe_load_imbalance"):
            assert got[key] == want[key], (got["step"], key)
    print("EP 2 vs EP 1 per step (loss rel, grad_norm rel): "
          + ", ".join(f"{abs(g['loss'] / w['loss'] - 1):.1e}/{abs(g['grad_norm'] / w['grad_norm'] - 1):.1e}"
                      for g, w in zip(ep2, ref)))

    # export-hf of the EP 2 checkpoint: both ranks' experts, loadable by transformers as the same model type
    ckpt = out / "checkpoints"
    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "export-hf", str(ckpt), "--out", str(export)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen3_moe"
    diff = max_diff(score(ckpt, LINES, tmp_path), hf_logprobs(export, LINES))
    print(f"score(EP 2 checkpoint) vs transformers(export-hf): max |Δ logprob| {diff:.2e}")
    assert diff <= TOL
    assert max_diff(hf_logprobs(export, LINES), hf_logprobs(hf, LINES)) > 1e-3  # the trained weights, not the initial

    # resumed at EP 1: the same run as the EP 1 reference
    code, log = finish(start(spec, out, "--resume", "--set", "trainer.expertParallelSize=1"))
    assert code == 0, log[-4000:]
    assert any("resumed from checkpoints/step_" in f.read_text() for f in (out / "logs").glob("trainer-0*.log"))
    assert_same_run(records(out), ref, rel=1e-5)


@pytest.mark.megatron
def test_moe_rl_with_routing_replay_keeps_the_logprobs_of_the_generator(tmp_path: Path) -> None:
    """examples/moe-rl.yaml (generated by the in-process engine, maxPolicyLag 0, routing replay, 2 trainer ranks at
    EP 2): the trainer's log-probabilities equal the generator's at every step (≤ 1e-3; seen ~5e-8, fp32), the
    router statistics are recorded. Without replay the same run gives the same figure here (fp32 on CPU: the
    generator's and the trainer's router scores agree to ~1e-7, so no top-k choice flips; docs/trainer.md)."""
    out = tmp_path / "rl"
    code, log = finish(start(ROOT / "examples" / "moe-rl.yaml", out, "--set", "rollout.numRollouts=3",
                             "--set", "rollout.samplesPerRollout=32", "--set", "trainer.expertParallelSize=2"))
    assert code == 0, log[-4000:]
    recs = records(out)
    assert len(recs) == 3
    for r in recs:
        assert r["logprob_abs_diff"] <= 1e-3, r["step"]
        assert r["moe_load_imbalance"] >= 1.0 and r["moe_aux_loss"] > 0, r["step"]
    print("routing replay, EP 2: logprob_abs_diff per step " + ", ".join(f"{r['logprob_abs_diff']:.1e}" for r in recs))
