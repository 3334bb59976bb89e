"""benchmarks/gpu_smoke.sh in its CPU dry mode: the script path the GPU check takes (wheel check, `trainingrun run`
of the local spec in bf16 and fp32, throughput lines, parity checks, result line) works here. The GPU figures
themselves come from running it on a CUDA machine."""

from __future__ import annotations

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
