"""A pool whose every engine fails the same way fails fast, with the cause (issue 30, item 10; acceptance): real vLLM
CPU servers and a real run.

A tiny Llama with head_dim 16 (hidden 64, 4 heads), which vLLM's CPU attention does not take: `trainingrun
validate` refuses it (tests/unit/test_api_validate.py), so the run is admitted by bypassing that check
(tests/admit_any_head_dim.py, as the launcher's command and its children's). The launcher's own pool of two servers
loads it and becomes healthy; the first request kills each engine ("RuntimeError: Unsupported CPU attention
configuration: head_dim=16 ..."; vLLM answers HTTP 500 "EngineCore encountered an issue", then one server exits 0
and the other may hang "waiting for background tasks"). Before issue 30 the run waited for
progressDeadlineSeconds (900 s) and failed naming the deadline; now it fails within 60 s of the engines' error, with
exit 78 and the engine's own message.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.services import make_tiny_llama, metrics_ports, require_vllm

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
ADMIT = ROOT / "tests" / "admit_any_head_dim.py"
CAUSE = "RuntimeError: Unsupported CPU attention configuration: head_dim=16"


def spec(path: Path, model: Path) -> Path:
    doc = {
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "vllm-broken"},
        "spec": {
            "seed": 3,
            "model": {"hf": str(model), "seqLength": 64},
            "trainer": {"replicas": 1, "gpusPerReplica": 0, "maxTokensPerGPU": 1024, "lossType": "ppo",
                        "checkpoint": {"interval": 100, "path": "checkpoints"}},
            "rollout": {
                "source": {"type": "generate", "generate": {
                    "prompts": {"type": "synthetic", "synthetic": {"task": "copy", "minLength": 2, "maxLength": 2}},
                    "sampling": {"maxNewTokens": 4}, "reward": {"type": "token_match"}}},
                "engine": {"type": "vllm", "replicas": 2, "vllm": {"dtype": "float32", "kvCacheGib": 1}},
                "samplesPerRollout": 16, "groupSize": 4, "numRollouts": 2, "filters": {"zeroVariance": False},
                "steps": {"policy": "dynamic"}},
            "weightSync": {"type": "disk"},
            "metrics": {"port": metrics_ports(2)},
            "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 0, "progressDeadlineSeconds": 900,
                              "roles": {"engine": {"maxRestarts": 4, "backoffSeconds": 0}}},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_two_engines_that_fail_every_request_the_same_way_end_the_run_within_a_minute_naming_the_error(
        tmp_path: Path):
    python = require_vllm()
    model = make_tiny_llama(python, tmp_path / "hd16", hidden=64)
    assert json.loads((model / "config.json").read_text())["hidden_size"] == 64
    refused = subprocess.run([sys.executable, "-m", "trainingrun", "validate", str(spec(tmp_path / "r.yaml", model))],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "head dimension 16" in refused.stderr, refused.stderr
    out = tmp_path / "run"
    env = {**os.environ, "TRAININGRUN_CHILD_COMMAND": shlex.join([sys.executable, str(ADMIT)]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ADMIT), "run", str(spec(tmp_path / "run.yaml", model)), "--out",
                             str(out), "--no-plot"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        # the engines' error: the first time either server's log shows it (polled), until the run ends
        seen = None
        deadline = time.monotonic() + 1000
        while proc.poll() is None and time.monotonic() < deadline:
            if seen is None and any(CAUSE in p.read_text(errors="replace") for p in (out / "logs").glob("engine-*.log")):
                seen = time.monotonic()
            time.sleep(0.5)
        ended = time.monotonic()
        assert proc.poll() is not None, "the run did not end"
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    print(log[-3000:])
    assert seen is not None, log[-4000:]
    print(f"the run ended {ended - seen:.1f}s after the engines' error showed in their logs")
    assert proc.returncode == 78, log[-4000:]
    assert ended - seen < 60, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    reason = summary["failure"]["reason"]
    assert CAUSE in reason, summary["failure"]  # the engine's own message, from its log
    assert "progress deadline" not in reason
    assert [a["attempt"] for a in summary["attempts"]] == [0]  # no restart of the group: a restart meets the same
