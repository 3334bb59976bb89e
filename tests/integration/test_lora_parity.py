"""LoRA parity with PEFT (issue 29 item 6): trainingrun's LoRA model (`modeling.lora.apply_lora` on the Megatron model
built from a Hugging Face directory) and PEFT's LoRA on the `transformers` model, given the same adapters, compute
the same per-token log-probabilities and the same gradients of every adapter — for a small random llama and qwen3
(head_dim ≠ hidden/heads, q/k norms), at tensor parallelism 1 and 2 (real Megatron code, CPU, fp32, gloo).

The Megatron side runs as a process pair (this file is the worker script): rank r saves its shard of every adapter
and of its gradient; the test joins the shards by the split rules (column-parallel B by rows, row-parallel A by
columns), loads them into PEFT's `lora_A` / `lora_B` of the matching projections, and compares. B is drawn non-zero
(a fresh adapter's B is 0, which would leave A's gradient 0 and test nothing). Also: the base is frozen (no gradient),
a fresh adapter (B = 0) leaves the model's log-probabilities exactly the base's, the merged weights
(`live_state_dict`) score like the adapters, and with dropout the replicated adapters (A of a column-, B of a
row-parallel layer) get the same gradient on both tensor-parallel ranks.

Experts (target `experts`): a small random Qwen3-MoE and Mixtral (4 experts, top 2) with adapters on q, k, v, o and every expert
at expert parallelism 1 and 2 (each rank its two experts' adapters; rank 1's loss is weighted 0, so every adapter's
gradient is that of rank 0's sequence), against PEFT's `target_parameters` on transformers' fused expert tensors,
the experts' adapters stacked as PEFT keeps them (`lora.to_peft`): the log-probabilities and every gradient, PEFT's
stacked gradients split back per expert.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.test_hf_architectures import make_model
from tests.integration.test_hf_models import make_hf_model
from tests.services import rank_group

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="peft (the dev extra) is not installed")

KINDS = ("llama", "qwen3")
RANK, ALPHA = 4, 8.0
TOKENS = [3, 9, 27, 17, 51, 25, 11, 40, 2, 63, 0, 7, 33, 12, 5, 60]
TOL = 1e-5
# our part -> PEFT's module under model.layers.<i>
HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
ROW = ("o", "down")  # row-parallel parts: A split by columns; the others' B by rows


MOE_KINDS = ("qwen3_moe", "mixtral")
MOE_TARGETS = ("attention_qkv", "attention_out", "experts")
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each kind's model and the worker's output at TP 1 and TP 2, the mixture of experts' at EP 1 and EP 2 (one
    process pair for all)."""
    root = tmp_path_factory.mktemp("lora")
    models = {"llama": make_hf_model(root / "llama"), "qwen3": make_model("qwen3", root / "qwen3"),
              **{k: make_model(k, root / k) for k in MOE_KINDS}}
    rank_group([sys.executable, __file__, str(root), *(f"{k}={models[k]}" for k in models)], 2, timeout=900)
    return {kind: root for kind in (*KINDS, *MOE_KINDS)} | {f"{k}-model": models[k] for k in models}


def _joined(root: Path, kind: str, tp: int, what: str) -> dict[str, "object"]:
    import torch

    shards = [torch.load(root / f"{kind}-tp{tp}-rank{r}.pt", weights_only=True)[what] for r in range(tp)]
    out = {}
    for name in shards[0]:
        part = name.rsplit(".", 1)[1].split("_")[0]
        split_a, split_b = part in ROW, part not in ROW
        is_a = name.endswith("_A")
        dim = 1 if is_a and split_a else 0 if (not is_a and split_b) else None
        out[name] = shards[0][name] if dim is None or tp == 1 else torch.cat([s[name] for s in shards], dim=dim)
    return out


def _peft_name(name: str) -> tuple[str, str]:
    """decoder.layers.<i>.<layer>.adapter.<part>_<A|B> -> (PEFT module path, lora_A | lora_B)."""
    layer = int(name.split(".")[2])
    part, ab = name.rsplit(".", 1)[1].split("_")
    return f"base_model.model.model.layers.{layer}.{HF_MODULE[part]}", f"lora_{ab}"


def _peft_reference(model_dir: Path, adapters: dict) -> tuple[list[float], dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, value in adapters.items():
            path, ab = _peft_name(name)
            getattr(modules[path], ab)["default"].weight.copy_(value)
    ids = torch.tensor([TOKENS])
    logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    logp.sum().backward()
    grads = {}
    for name in adapters:
        path, ab = _peft_name(name)
        grads[name] = getattr(modules[path], ab)["default"].weight.grad.detach().clone()
    return logp.detach().tolist(), grads


def _rel(a, b) -> float:
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.megatron
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_lora_logprobs_and_gradients_match_peft(runs: dict, kind: str, tp: int) -> None:
    import torch

    root = runs[kind]
    adapters = _joined(root, kind, tp, "params")
    grads = _joined(root, kind, tp, "grads")
    summary = json.loads((root / f"{kind}-tp{tp}.json").read_text())
    assert summary["frozen_base_grads"] == 0 and summary["base_trainable"] == 0, summary
    assert summary["fresh_equals_base"], summary  # B = 0: the base model's log-probabilities, bit for bit
    assert summary["dropout_tp_same"], summary  # with dropout, the replicated adapters stay replicas
    assert len(adapters) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    ref_logp, ref_grads = _peft_reference(runs[f"{kind}-model"], adapters)
    logp_rel = _rel(summary["logprobs"], ref_logp)
    grad_rel = max(_rel(grads[n], ref_grads[n]) for n in grads)
    merged_rel = _rel(summary["merged_logprobs"], ref_logp)
    print(f"{kind} TP {tp}: max relative difference to PEFT: logprobs {logp_rel:.2e}, adapter gradients "
          f"{grad_rel:.2e}, merged weights' logprobs {merged_rel:.2e}")
    assert logp_rel <= TOL and grad_rel <= TOL and merged_rel <= TOL
    # the adapters really change the model (a test of B = 0 or of the wrong adapters would not)
    assert _rel(summary["logprobs"], summary["base_logprobs"]) > 1e-3
    assert all(float(g.abs().max()) > 0 for g in ref_grads.values())
    assert torch.isfinite(torch.tensor(summary["logprobs"])).all()


def _joined_ep(root: Path, kind: str, ep: int, what: str) -> dict:
    """The whole set of adapter tensors of the EP run: each rank's experts under their global numbers, the
    replicated adapters from rank 0 (canonical names)."""
    import torch

    from trainingrun.modeling.convert import ep_layout

    out = {}
    for r in range(ep):
        part = torch.load(root / f"{kind}-ep{ep}-rank{r}.pt", weights_only=True)[what]
        for name, value in part.items():
            e = ep_layout(name)
            if e is None:
                if r == 0:
                    out[name] = value
            else:
                head, tail = name.split(f".local_experts.{e}.")
                out[f"{head}.local_experts.{r * 4 // ep + e}.{tail}"] = value
    return out


def _peft_moe_reference(model_dir: Path, peft_tensors: dict) -> tuple[list[float], dict]:
    """PEFT on transformers' Qwen3-MoE with `peft_tensors` (PEFT's names, the experts stacked): log-probabilities of
    TOKENS and the gradient of their sum for every tensor, under the same names."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            target_parameters=EXPERT_PARAMS))
    params = {n.replace(".default.", "."): p for n, p in model.named_parameters() if "lora_" in n}
    assert set(params) == set(peft_tensors), sorted(set(params) ^ set(peft_tensors))[:4]
    with torch.no_grad():
        for name, value in peft_tensors.items():
            params[name].copy_(value)
    ids = torch.tensor([TOKENS])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    logp.sum().backward()
    return logp.detach().tolist(), {n: p.grad.detach().clone() for n, p in params.items()}


@pytest.mark.megatron
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_expert_lora_logprobs_and_gradients_match_peft(runs: dict, kind: str, ep: int) -> None:
    import torch

    from trainingrun.modeling.lora import to_peft

    root = runs[kind]
    adapters, grads = _joined_ep(root, kind, ep, "params"), _joined_ep(root, kind, ep, "grads")
    summary = json.loads((root / f"{kind}-ep{ep}.json").read_text())
    assert summary["frozen_base_grads"] == 0 and summary["base_trainable"] == 0, summary
    assert summary["fresh_equals_base"], summary
    assert summary["expert_adapters_allreduce"] == [False], summary  # reduced over the expert-data-parallel group
    # 2 layers x (4 experts x (gate_up, down) + q k v o) x (A, B)
    assert len(adapters) == 2 * (4 * 2 + 4) * 2, sorted(adapters)
    assert tuple(adapters["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.adapter.gate_up_A"].shape) == \
        (RANK, 32)
    assert tuple(adapters["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.adapter.down_B"].shape) == (32, RANK)
    peft_tensors, modules, params = to_peft(adapters, 4)
    assert modules == ["k_proj", "o_proj", "q_proj", "v_proj"] and params == EXPERT_PARAMS
    ref_logp, ref_grads = _peft_moe_reference(runs[f"{kind}-model"], peft_tensors)
    ours = to_peft(grads, 4)[0]
    logp_rel = _rel(summary["logprobs"], ref_logp)
    grad_rel = max(_rel(ours[n], ref_grads[n]) for n in ref_grads)
    expert_rel = max(_rel(ours[n], ref_grads[n]) for n in ref_grads if ".mlp.experts." in n)
    merged_rel = _rel(summary["merged_logprobs"], ref_logp)
    print(f"{kind} EP {ep}: max relative difference to PEFT: logprobs {logp_rel:.2e}, adapter gradients "
          f"{grad_rel:.2e} (experts' {expert_rel:.2e}), merged weights' logprobs {merged_rel:.2e}")
    assert logp_rel <= TOL and grad_rel <= TOL and merged_rel <= TOL
    assert _rel(summary["logprobs"], summary["base_logprobs"]) > 1e-3
    # the experts' adapters are compared where they matter: in every layer at least 3 of the 4 experts got tokens
    # (PEFT's per-expert gradient slices not 0; on these 16 tokens one Mixtral expert of layer 1 gets none)
    for name, g in ref_grads.items():
        if ".mlp.experts." in name:
            per = g.reshape(4, RANK, -1) if name.endswith("lora_A.weight") else g.reshape(g.shape[0], RANK, 4)
            amax = per.abs().amax(dim=(1, 2)) if name.endswith("lora_A.weight") else per.abs().amax(dim=(0, 1))
            assert int((amax > 0).sum()) >= 3, (name, amax)
    assert torch.isfinite(torch.tensor(summary["logprobs"])).all()


# ---------------------------------------------------------------------------------------------- subprocess worker
def _forward_logprobs(model, device):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    n = len(TOKENS)
    ids = torch.tensor(TOKENS, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    logits = model(input_ids=ids[None], position_ids=torch.arange(n, device=device)[None], attention_mask=None,
                   packed_seq_params=params)[0]
    return torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)


def _worker(out: str, models: list[str]) -> None:
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed

    device = prepare_device(0)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling.lora import LoRAAdapter, apply_lora, live_state_dict
    from trainingrun.modeling.lora_targets import LoRASettings
    from trainingrun.modeling.convert import canonical_names
    from trainingrun.modeling.model import load_canonical_state

    lora = LoRASettings(rank=RANK, alpha=ALPHA)
    for tp in (1, 2):
        for item in models:
            kind, path = item.split("=", 1)
            if kind in MOE_KINDS:
                continue
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            init_distributed(device, tp=tp)
            set_seed(1)
            arch = ModelSpec(hf=path, attentionBackend="sdpa").resolved()
            model = build_model(arch, device, parallel_output=False)
            for p in model.parameters():  # frozen as apply_lora leaves it (Megatron runs frozen weights its own way)
                p.requires_grad_(False)
            with torch.no_grad():
                base_logp = _forward_logprobs(model, device)
            tp_rank = ps.get_tensor_model_parallel_rank()
            apply_lora(model, arch, lora, seed=7, tp=(tp_rank, tp))
            with torch.no_grad():
                fresh = _forward_logprobs(model, device)
                for name, module in model.named_modules():  # B non-zero: drawn whole, this rank's rows kept
                    if isinstance(module, LoRAAdapter):
                        for part in module.part_names:
                            b = getattr(module, f"{part}_B")
                            rows = b.shape[0] * (tp if module.kind == "column" else 1)
                            gen = torch.Generator().manual_seed(sum(map(ord, f"{name}.{part}")))
                            full = torch.randn(rows, b.shape[1], generator=gen) * 0.3
                            b.copy_(torch.chunk(full, tp, 0)[tp_rank] if module.kind == "column" else full)
            logp = _forward_logprobs(model, device)
            logp.sum().backward()
            params, grads = {}, {}
            for name, p in model.named_parameters():
                if ".adapter." in name:
                    params[name] = p.detach().clone()
                    grads[name] = p.grad.detach().clone()
            base_grads = sum(1 for n, p in model.named_parameters() if ".adapter." not in n and p.grad is not None)
            trainable = sum(1 for n, p in model.named_parameters() if ".adapter." not in n and p.requires_grad)
            merged = build_model(arch, device, parallel_output=False, load_weights=False)
            load_canonical_state(merged, canonical_names(live_state_dict(model)))
            with torch.no_grad():
                merged_logp = _forward_logprobs(merged, device)
            tp_same = True
            if tp > 1:  # dropout: the replicated A of a column-parallel layer gets the same gradient on both TP ranks
                for module in model.modules():
                    if isinstance(module, LoRAAdapter):
                        module.dropout = 0.5
                model.zero_grad(set_to_none=True)
                _forward_logprobs(model, device).sum().backward()
                for name, p in model.named_parameters():
                    if ".adapter." in name and not getattr(p, "tensor_model_parallel", False):
                        both = [torch.empty_like(p.grad) for _ in range(tp)]
                        dist.all_gather(both, p.grad.contiguous(), group=ps.get_tensor_model_parallel_group())
                        tp_same = tp_same and torch.equal(both[0], both[1])
            rank = dist.get_rank()
            if rank < tp:
                torch.save({"params": params, "grads": grads}, Path(out) / f"{kind}-tp{tp}-rank{rank}.pt")
            if rank == 0:
                (Path(out) / f"{kind}-tp{tp}.json").write_text(json.dumps({
                    "logprobs": logp.detach().tolist(), "base_logprobs": base_logp.tolist(),
                    "merged_logprobs": merged_logp.tolist(), "fresh_equals_base": bool(torch.equal(fresh, base_logp)),
                    "frozen_base_grads": base_grads, "base_trainable": trainable, "dropout_tp_same": tp_same}))
            dist.barrier()
    for item in models:
        kind, path = item.split("=", 1)
        if kind in MOE_KINDS:
            for ep in (1, 2):
                _moe_worker(out, kind, path, ep, device)


def _moe_worker(out: str, kind: str, path: str, ep: int, device) -> None:
    """The mixture of experts `kind` at expert parallelism `ep` (2 ranks: EP 1 is two data-parallel replicas): attention and experts
    adapters, B drawn from each adapter's global name; rank 0's loss backward (rank 1's weighted 0)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling.convert import canonical_names, ep_global_name
    from trainingrun.modeling.lora import LoRAAdapter, apply_lora, live_state_dict
    from trainingrun.modeling.lora_targets import LoRASettings
    from trainingrun.modeling.model import build_model, init_distributed, load_canonical_state, set_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_distributed(device, ep=ep)
    set_seed(1)
    arch = ModelSpec(hf=path, attentionBackend="sdpa").resolved()
    model = build_model(arch, device, parallel_output=False)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        base_logp = _forward_logprobs(model, device)
    ep_rank = ps.get_expert_model_parallel_rank()
    apply_lora(model, arch, LoRASettings(rank=RANK, alpha=ALPHA, targets=MOE_TARGETS), seed=7, ep=(ep_rank, ep))
    with torch.no_grad():
        fresh = _forward_logprobs(model, device)
    # B drawn under the global name (the same expert gets the same B at EP 1 and EP 2)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoRAAdapter):
                for part in module.part_names:
                    b = getattr(module, f"{part}_B")
                    gen = torch.Generator().manual_seed(sum(map(ord, ep_global_name(f"{name}.{part}", arch, ep_rank,
                                                                                    ep))))
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    logp = _forward_logprobs(model, device)
    (logp.sum() * (1.0 if dist.get_rank() == 0 else 0.0)).backward()
    params, grads = {}, {}
    for name, p in model.named_parameters():
        if ".adapter." in name:
            params[name] = p.detach().clone()
            grads[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    base_grads = sum(1 for n, p in model.named_parameters() if ".adapter." not in n and p.grad is not None)
    trainable = sum(1 for n, p in model.named_parameters() if ".adapter." not in n and p.requires_grad)
    allreduce = sorted({getattr(p, "allreduce", True) for n, p in model.named_parameters()
                        if ".adapter." in n and ".local_experts." in n})
    merged = build_model(arch, device, parallel_output=False, load_weights=False)
    load_canonical_state(merged, canonical_names(live_state_dict(model)))
    with torch.no_grad():
        merged_logp = _forward_logprobs(merged, device)
    rank = dist.get_rank()
    if rank < ep:
        torch.save({"params": params, "grads": grads}, Path(out) / f"{kind}-ep{ep}-rank{rank}.pt")
    if rank == 0:
        (Path(out) / f"{kind}-ep{ep}.json").write_text(json.dumps({
            "logprobs": logp.detach().tolist(), "base_logprobs": base_logp.tolist(),
            "merged_logprobs": merged_logp.tolist(), "fresh_equals_base": bool(torch.equal(fresh, base_logp)),
            "frozen_base_grads": base_grads, "base_trainable": trainable, "expert_adapters_allreduce": allreduce}))
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
