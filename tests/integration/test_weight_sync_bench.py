"""benchmarks/weight_sync.py in its CPU mode with a tiny model: every line is JSON, every figure positive, the four
engine counts and the two peak sizes are there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_weight_sync_benchmark_cpu_lines():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--params", "300000",
                          "--bucket-mib", "1", "--device", "cpu"], check=True, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    syncs = [r for r in lines if r["kind"] == "sync"]
    assert [r["engines"] for r in syncs] == [1, 2, 4, 8]
    assert all(r["seconds"] > 0 and r["gbps"] > 0 and r["bytes"] > 0 for r in syncs)
    (memcpy,) = [r for r in lines if r["kind"] == "memcpy"]
    assert memcpy["gbps"] > 0
    peaks = [r for r in lines if r["kind"] == "peak"]
    assert [r["params"] for r in peaks] == [300000, 600000]
    assert all(r["model_bytes"] > 0 and r["bucket_bytes"] == 1 << 20 and r["peak_extra_bytes"] >= 0 for r in peaks)
