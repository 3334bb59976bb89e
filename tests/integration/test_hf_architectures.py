"""Every architecture from config.json (qwen2, qwen3, qwen3_moe, mixtral, qwen2_moe with its gated shared expert), on real Megatron code and real
`transformers` (small random models saved by transformers, CPU, fp32).

* `trainingrun score` on each HF directory gives transformers' per-token log-probabilities (≤ 1e-4). Before the
  qwen3 / qwen3_moe / mixtral architectures, `score` refused them ("not supported; allowed: llama, mistral, qwen2").
* HF → Megatron → HF is bit-exact for each, with each rank holding a part: the dense models at TP 2 (each rank a
  shard), the mixtures of experts at EP 2 (each rank half of the experts), read back from the live models through
  the one gathering function of the weight publishers (`modeling.state.gather_live_state`) and converted back.
* Routing replay (the mixtures of experts, EP 2): the router hook records each token's experts; replaying them gives
  the same logits bit for bit, replaying other experts routes the tokens there and changes the logits, −1 leaves the
  router its own choice.
* One process pair runs all four (Megatron's parallel state rebuilt per model), this file as the worker script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.test_hf_models import LINES, TOL, hf_logprobs, max_diff, score
from tests.services import rank_group

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=50000.0,
            tie_word_embeddings=False)
KINDS = {
    "qwen2": {},
    "qwen3": dict(head_dim=16),  # head_dim ≠ hidden / heads, as Qwen3's
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                      shared_expert_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[]),
}
MOE = ("qwen3_moe", "mixtral", "qwen2_moe")


def make_model(kind: str, out: Path, seed: int = 0) -> Path:
    """A random model of `kind` saved by transformers; weights N(0, 0.1), norms around 1 as trained models have."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **BASE, **KINDS[kind])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
            if p.ndim == 1:
                p.add_(1.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {kind: make_model(kind, root / kind) for kind in KINDS}


@pytest.mark.megatron
@pytest.mark.parametrize("kind", list(KINDS))
def test_score_matches_transformers(models: dict[str, Path], kind: str, tmp_path: Path) -> None:
    diff = max_diff(score(models[kind], LINES, tmp_path), hf_logprobs(models[kind], LINES))
    print(f"{kind}: score vs transformers max |Δ logprob| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.megatron
def test_hf_to_megatron_to_hf_is_bit_exact_at_tp2_and_ep2(models: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling import convert

    rank_group([sys.executable, __file__, str(tmp_path), *(f"{k}={models[k]}" for k in KINDS)], 2, timeout=600)
    for kind in KINDS:
        arch = ModelSpec(hf=str(models[kind])).resolved()
        local = torch.load(tmp_path / f"{kind}-rank1-local.pt", weights_only=True)
        if kind in MOE:  # rank 1 really holds half of the experts, numbered 0, 1 locally
            assert arch.moe is not None and arch.moe.num_experts == 4
            assert not [n for n in local if ".local_experts.2." in n or ".local_experts.3." in n]
            assert [n for n in local if ".local_experts.1." in n]
        else:  # a TP shard
            assert local["embedding.word_embeddings.weight"].shape[0] == arch.vocab_size // 2
        full = torch.load(tmp_path / f"{kind}-gathered.pt", weights_only=True)
        back = convert.megatron_to_hf(full, arch)
        original = load_file(str(models[kind] / "model.safetensors"))
        assert set(back) == set(original), kind
        for name, tensor in original.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), f"{kind}: {name}"
        if kind in MOE:
            replay = json.loads((tmp_path / f"{kind}-replay.json").read_text())
            assert replay["shape"] == [16, arch.num_layers, arch.moe.top_k], replay
            assert replay["same_logits"] and replay["same_choice"], replay
            assert replay["forced_routed"] and replay["forced_change"] > 1e-3, replay
            assert replay["unset_logits"] and replay["unset_choice"], replay


# ---------------------------------------------------------------------------------------------- subprocess worker
def _worker(out: str, models: list[str]) -> None:
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed

    device = prepare_device(0)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling.convert import canonical_names
    from trainingrun.modeling.state import gather_live_state

    for item in models:
        kind, path = item.split("=", 1)
        moe = kind in MOE
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_distributed(device, tp=1 if moe else 2, ep=2 if moe else 1)
        set_seed(1)
        arch = ModelSpec(hf=path).resolved()
        model = build_model(arch, device)
        if dist.get_rank() == 1:
            torch.save(canonical_names(model.state_dict()), Path(out) / f"{kind}-rank1-local.pt")
        full = gather_live_state(model, arch, tp_group=ps.get_tensor_model_parallel_group(),
                                 tp_size=ps.get_tensor_model_parallel_world_size(),
                                 tp_rank=ps.get_tensor_model_parallel_rank(),
                                 ep_group=ps.get_expert_model_parallel_group(),
                                 ep_size=ps.get_expert_model_parallel_world_size(),
                                 ep_rank=ps.get_expert_model_parallel_rank())
        if dist.get_rank() == 0:
            torch.save(full, Path(out) / f"{kind}-gathered.pt")
        if moe:
            replay = _replay_checks(model, arch, device)
            if dist.get_rank() == 0:
                (Path(out) / f"{kind}-replay.json").write_text(json.dumps(replay))
        dist.barrier()


def _replay_checks(model, arch, device) -> dict:
    """Routing replay through the router hook (`modeling.moe.RoutingHooks`), at EP 2: record the router's own
    choices; replaying them gives the same logits; replaying other experts routes there (recorded = given) and
    changes the logits; −1 everywhere leaves the router its choice."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from trainingrun.modeling.moe import RoutingHooks

    hooks = RoutingHooks.install(model, arch)
    n = 16
    ids = torch.arange(n, device=device)[None] * 3 % arch.vocab_size
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)

    def forward(**how):
        hooks.prepare(record=True, **how)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=torch.arange(n, device=device)[None], attention_mask=None,
                           packed_seq_params=params)
        return logits.float(), hooks.recorded().long()

    plain, chosen = forward()
    same, again = forward(replay=chosen)
    other = (chosen + 1) % arch.moe.num_experts  # still k distinct experts per token
    forced, routed = forward(replay=other)
    unset, own = forward(replay=torch.full_like(chosen, -1))
    return {"shape": list(chosen.shape), "same_logits": bool(torch.equal(same, plain)),
            "same_choice": bool(torch.equal(again, chosen)), "forced_routed": bool(torch.equal(routed, other)),
            "forced_change": float((forced - plain).abs().max()), "unset_logits": bool(torch.equal(unset, plain)),
            "unset_choice": bool(torch.equal(own, chosen))}


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
