"""A `trainingrun run` with `spec.trainer.lora` (issue 29 items 1 and 3) from a Hugging Face Llama directory, on real
Megatron code (CPU, gloo):

* TP 1 and TP 2 train the same adapters (per-step losses within 1e-5 relative; the adapters are initialised the same
  at both layouts) and the loss falls;
* the end-of-run checkpoint holds Adam moments for the adapters only (none for the frozen base) and every adapter at
  its whole shape (stored once, whatever the TP size);
* `export-hf` of the checkpoint writes the merged model (base + scale·B·A), which `transformers` scores like
  `trainingrun score` of the checkpoint, and which differs from the base (the adapters trained).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_hf_models import LINES, TOL, hf_logprobs, make_hf_model, max_diff, score
from tests.localrun import ROOT, finish, records, start

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


def _spec(path: Path, hf: Path, tp: int, extra: str = "") -> Path:
    path.write_text(f"""
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {{name: lora-tp{tp}}}
spec:
  seed: 5
  model: {{hf: {hf}, seqLength: 64}}
  trainer:
    replicas: {tp}
    tensorParallelSize: {tp}
    maxTokensPerGPU: 512
    lora: {{rank: 4, alpha: 8}}
    optimizer: {{lr: 0.01, clipGrad: 0.0}}
    checkpoint: {{interval: 0, path: checkpoints}}{extra}
  rollout:
    source: {{type: synthetic, synthetic: {{task: reverse, minLength: 4, maxLength: 12, vocabSize: 16}}}}
    samplesPerRollout: 32
    groupSize: 4
    numRollouts: 3
  metrics: {{enabled: false}}
""")
    return path


@pytest.mark.megatron
def test_lora_run_trains_alike_at_tp1_and_tp2_checkpoints_adapters_only_and_exports_merged(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from trainingrun.trainer.checkpoint import latest_checkpoint, read_tensors

    hf = make_hf_model(tmp_path / "hf")
    losses = {}
    for tp in (1, 2):
        out = tmp_path / f"run-tp{tp}"
        code, log = finish(start(_spec(tmp_path / f"tp{tp}.yaml", hf, tp), out))
        assert code == 0, log[-4000:]
        losses[tp] = [r["loss"] for r in records(out)]
    assert len(losses[1]) == 3
    for a, b in zip(losses[2], losses[1], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), losses
    assert losses[1][-1] < losses[1][0], losses

    ckpt = latest_checkpoint(tmp_path / "run-tp2" / "checkpoints")
    assert ckpt is not None
    tensors = read_tensors(ckpt)
    moments = [k for k in tensors if k.startswith("optimizer.state.exp_avg.")]
    assert moments and all(".adapter." in k for k in moments), moments  # no optimizer state for the base
    assert len(moments) == 7 * 2  # q k v o gate up down, A and B (layers stacked)
    assert tuple(tensors["decoder.layers.self_attention.linear_qkv.adapter.k_B"].shape) == (2, 16, 4)  # whole
    assert tuple(tensors["decoder.layers.self_attention.linear_proj.adapter.o_A"].shape) == (2, 4, 32)
    assert float(tensors["decoder.layers.self_attention.linear_qkv.adapter.q_B"].abs().max()) > 0  # trained
    assert "decoder.layers.self_attention.linear_qkv.weight" in tensors  # the (frozen) base is kept too

    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "export-hf", str(ckpt), "--out", str(export)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    merged, base = load_file(str(export / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert set(merged) == set(base)
    assert not torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not targeted
    diff = max_diff(score(ckpt, LINES, tmp_path), hf_logprobs(export, LINES))
    print(f"LoRA TP2 losses {losses[2]}; score(checkpoint) vs transformers(export-hf): max |Δ logprob| {diff:.2e}")
    assert diff <= TOL
