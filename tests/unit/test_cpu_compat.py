"""The CPU shim's import of Megatron (trainingrun.modeling.cpu_compat, item 6): Megatron's fused element-wise
kernels are left eager and neither TorchDynamo nor Inductor is imported into a CPU trainer (about 3.6 s of CPU time
in every trainer process), while `torch.compile` itself stays the real one for everything else; item 7: nor is
wandb (about 0.4 s), while the run's own `import wandb` still gets the real module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys, torch
compile_ = torch.compile
from trainingrun.modeling.model import prepare_device
prepare_device(0)
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.transformer.moe.token_dispatcher
from megatron.core.fusions import fused_bias_swiglu, fused_bias_gelu
from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
x = torch.randn(3, 8)
hidden_wandb = "wandb" in sys.modules
import importlib.util
if importlib.util.find_spec("wandb") is not None:  # the run's own spec.metrics.wandb still gets the real one
    import wandb
    real_wandb = hasattr(wandb, "init")
else:
    real_wandb = None
print(json.dumps({"wandb_imported": hidden_wandb, "real_wandb": real_wandb,
    "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor.compile_fx" in sys.modules,
    "compile_restored": torch.compile is compile_,
    "plain": [type(f).__name__ for f in (fused_bias_swiglu.bias_swiglu, fused_bias_gelu.bias_gelu)],
    "swiglu_error": float((fused_bias_swiglu.bias_swiglu(x, torch.zeros(8))
                           - torch.nn.functional.silu(x[:, :4]) * x[:, 4:]).abs().max()),
}))
"""


@pytest.mark.megatron
def test_megatron_on_the_cpu_imports_no_compiler_and_runs_its_fusions_eagerly():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["dynamo"] and not got["inductor"], got  # before the shim's item 6: both imported by Megatron
    assert got["compile_restored"], got
    assert not got["wandb_imported"] and got["real_wandb"] in (True, None), got  # item 7: before, Megatron imported it
    assert got["plain"] == ["function", "function"], got
    assert got["swiglu_error"] < 1e-6, got  # the eager kernel computes what it must
