#!/usr/bin/env bash
# GPU readiness check of the trainer (issue #10 item 11). On a machine with CUDA:
#   bash benchmarks/gpu_smoke.sh            # < 5 minutes on one H100/H200
# It trains through the real `trainingrun run` path (rollout + trainer processes, file store, NCCL):
#   * the TransformerEngine layer spec in bf16 (packed sequences through TE attention) when transformer_engine
#     imports, and its loss parity with the local spec;
#   * the local spec (Megatron's own layers + an SDPA core attention with a block-diagonal mask for packed
#     sequences) in bf16 and fp32: tokens/s, MFU, per-step loss parity bf16 vs fp32;
#   * a small model in fp32 on CUDA against the same run on the CPU (gloo): per-step losses.
# Prints `SMOKE ...` lines and `SMOKE RESULT PASS|FAIL`; exits 0 when every check passed (a missing TE is
# reported, not a failure). On a machine without CUDA: `bash benchmarks/gpu_smoke.sh --cpu` runs the same script
# path with tiny models on the CPU (gloo) in about two minutes (what the tests can check here).
#
# Throughput mode (issue #23 item 4), one prepared command, under 8 minutes on one H200:
#   bash benchmarks/gpu_smoke.sh --throughput [--json FILE]   # --throughput --cpu: its dry mode
# a ~1B Llama (seqLength 8192, maxTokensPerGPU 16384, bf16, heavy-tailed packed lengths) trained for each attention
# backend the device offers (te, flash, sdpa): tokens/s/GPU, MFU counting attention FLOPs, peak memory, the
# in-process engine's generation tokens/s, loss parity between backends (benchmarks/gpu_throughput.py).
#
# Packages: the trainer needs megatron-core, pydantic and psutil (Megatron's checkpoint writer). When they do not import and wheels were carried in
# .whl/ (see docs/trainer.md, "GPU smoke check"), they are installed without network into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && ! command -v nvidia-smi >/dev/null 2>&1; then PY=.venv/bin/python; fi

if ! "$PY" -c "import megatron.core, pydantic, psutil" >/dev/null 2>&1; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "SMOKE setup: megatron-core/pydantic/psutil missing: installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "SMOKE setup: megatron-core, pydantic or psutil does not import and no wheels in .whl/ (see docs/trainer.md)"
    echo "SMOKE RESULT FAIL"
    exit 1
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--throughput" ]; then shift; exec "$PY" benchmarks/gpu_throughput.py "$@"; fi
exec "$PY" benchmarks/gpu_smoke.py "$@"
