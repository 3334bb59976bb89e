"""The memory plan against real processes (issue 28).

1. What real Megatron models keep for the backward: this file, run as a script (gloo on the CPU, a subprocess per
   tensor-parallel size), builds the trainer's model of several architectures (llama with grouped-query attention in
   fp32, Qwen3-like bf16 with query/key norms, gpt, a mixture of experts; TP 1, and TP 2 on two ranks), runs one
   packed micro-batch forward and the loss under `torch.autograd.graph.saved_tensors_hooks`, and counts every storage
   autograd saved (parameters excluded) — which must equal the plan's activations + attention + logits within 2 %.
2. The measured peak of real trainer processes: `benchmarks/memory_plan.py` runs `trainingrun run` of a small llama
   at two token caps (1,024 and 4,096 tokens, fp32, sdpa) with every child's peak resident set recorded; the plan's
   per-process total must be within 25 % of it, and must grow with the cap as the measurement does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.services import rank_group

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TP1_ARCHS = {
    "llama-gqa-fp32": dict(architecture="llama", num_layers=2, hidden_size=128, num_attention_heads=4,
                           num_query_groups=2, ffn_hidden_size=384, vocab_size=1000, seq_length=1024),
    "qwen3-bf16": dict(architecture="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       head_dim=64, ffn_hidden_size=384, vocab_size=1000, seq_length=1024, qk_norm=True,
                       precision="bf16"),
    "gpt-fp32": dict(architecture="gpt", num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1000,
                     seq_length=1024),
    "moe-fp32": dict(architecture="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=384, vocab_size=1000, seq_length=1024,
                     moe=dict(num_experts=4, top_k=2, ffn_hidden_size=96)),
}
TP2_ARCHS = {"llama-gqa-bf16-tp2": dict(TP1_ARCHS["llama-gqa-fp32"], num_query_groups=2, precision="bf16")}
TOKENS, DOCUMENTS = 512, 3


@pytest.mark.megatron
@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_counts_what_megatron_keeps_for_the_backward(tmp_path: Path, tp: int) -> None:
    out = tmp_path / "saved.json"
    rank_group([sys.executable, __file__, str(out), str(tp)], tp, timeout=300)
    result = json.loads(out.read_text())
    assert set(result) == set(TP1_ARCHS if tp == 1 else TP2_ARCHS)
    for name, r in result.items():
        assert r["saved"] > 0, name
        assert abs(r["plan"] - r["saved"]) <= 0.02 * r["saved"], (name, r)


@pytest.mark.megatron
def test_the_plan_is_within_25_percent_of_the_measured_peak_of_trainer_processes(tmp_path: Path) -> None:
    from benchmarks.memory_plan import measure

    small, big = (measure(name, tmp_path) for name in ("llama-1k", "llama-4k"))
    print(json.dumps(small), json.dumps(big), sep="\n")
    for r in (small, big):
        assert r["steps"] == 2 and r["tokens_per_micro_batch"] > 0.95 * r["max_tokens_per_gpu"], r
        assert abs(r["plan_gib"] - r["measured_gib"]) <= 0.25 * r["measured_gib"], r
    # the growth with the token cap (activations, attention, logits) is the plan's too, not only the baseline
    grown_plan, grown = big["plan_gib"] - small["plan_gib"], big["measured_gib"] - small["measured_gib"]
    assert grown > 0.3 and abs(grown_plan - grown) <= 0.25 * grown, (small, big)


# ---------------------------------------------------------------------------------------------- subprocess worker
def _saved_bytes(arch, tp: int) -> tuple[int, int]:
    """(bytes autograd saved in one packed forward + loss of `arch`, the plan's activations + attention + logits)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from trainingrun.modeling.memory import TrainerSettings, trainer_plan
    from trainingrun.modeling.model import build_model, prepare_device, set_seed
    from trainingrun.trainer.loss import token_logprobs
    from trainingrun.trainer.step import logit_rows

    set_seed(0)
    model = build_model(arch, prepare_device(0))
    lens = [TOKENS // DOCUMENTS] * DOCUMENTS
    lens[-1] += TOKENS - sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, arch.vocab_size, (1, TOKENS))
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None, packed_seq_params=packed)
        token_logprobs(logit_rows(logits), ids[0], 1.0, overwrite=True)
    role = trainer_plan(arch, TrainerSettings(tokens=TOKENS, tensor_parallel=tp))
    plan = sum(t.bytes for t in role.terms if t.key in ("activations", "attention", "logits"))
    return sum(saved.values()), plan


def _worker(out_path: str, tp: int) -> None:
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.model import init_distributed, prepare_device

    init_distributed(prepare_device(0), tp=tp)
    result = {}
    for name, fields in (TP1_ARCHS if tp == 1 else TP2_ARCHS).items():
        saved, plan = _saved_bytes(resolve(**fields), tp)
        result[name] = {"saved": saved, "plan": plan}
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
