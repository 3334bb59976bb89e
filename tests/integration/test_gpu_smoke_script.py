"""benchmarks/gpu_smoke.sh in its CPU dry mode: the script path the GPU check takes (wheel check, `trainingrun run`
of the local spec in bf16 and fp32, throughput lines, parity checks, result line) works here. The GPU figures
themselves come from running it on a CUDA machine; its throughput mode (`--throughput`) likewise."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.megatron
def test_gpu_smoke_script_dry_mode_passes_and_reports(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "benchmarks/gpu_smoke.sh", "--cpu", "--keep", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("SMOKE ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1] == "SMOKE RESULT PASS"
    assert any("transformer_engine ABSENT" in x for x in lines)
    assert any(x.startswith("SMOKE bf16-vs-fp32: ok") for x in lines)
    assert any(x.startswith("SMOKE local-bf16:") and "tokens/s" in x for x in lines)
    assert (tmp_path / "local-fp32" / "metrics.jsonl").is_file()


@pytest.mark.megatron
def test_gpu_smoke_throughput_dry_mode_trains_sdpa_and_names_what_the_cpu_lacks(tmp_path: Path) -> None:
    """`--throughput --cpu`: the throughput mode's path (one training subprocess per backend, the engine's
    generation, the figures) with a tiny model. On the CPU te and flash are reported with the trainer's refusal and
    sdpa trains; the MFU's attention term is Σ s² over the packed samples (6·L·H·d·s² each), not T² per micro-batch."""
    out = tmp_path / "throughput.json"
    proc = subprocess.run(["bash", "benchmarks/gpu_smoke.sh", "--throughput", "--cpu", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("SMOKE ")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1] == "SMOKE RESULT PASS"
    te = next(x for x in lines if x.startswith("SMOKE throughput te:"))
    flash = next(x for x in lines if x.startswith("SMOKE throughput flash:"))
    assert "not available here" in te and "TransformerEngine" in te and "CUDA" in te
    assert "not available here" in flash and "CUDA" in flash
    assert any(x.startswith("SMOKE throughput sdpa:") and "tokens/s/GPU" in x for x in lines)
    assert any(x.startswith("SMOKE throughput sdpa generation:") and "tokens/s" in x for x in lines)
    report = json.loads(out.read_text())
    assert set(report["backends"]["te"]) == set(report["backends"]["flash"]) == {"refused"}
    sdpa = report["backends"]["sdpa"]
    assert sdpa["backend"] == "sdpa" and sdpa["layer_impl"] == "local"
    steps = sdpa["steps"]
    assert len(steps) >= 2 and all(s["tokens"] >= 1024 and s["microbatches"] >= 2 for s in steps)  # packed at 512
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)
    m = report["model"]
    d = m["hiddenSize"] // m["numAttentionHeads"]
    attention = sum(6 * m["numLayers"] * m["numAttentionHeads"] * d * s["sum_len_sq"] for s in steps[1:])
    secs = sum(s["seconds"] for s in steps[1:])
    fig = sdpa["figures"]
    assert fig["tokens_per_s"] == pytest.approx(sum(s["tokens"] for s in steps[1:]) / secs)
    assert fig["attention_share"] == pytest.approx(attention / (fig["flops_per_s"] * secs))
    assert max(s["sum_len_sq"] for s in steps) < max(s["tokens"] for s in steps) ** 2 / 2  # per sample, not per batch
    gen = sdpa["generation"]
    assert gen["generated_tokens"] > 0 and gen["tokens_per_s"] > 0
