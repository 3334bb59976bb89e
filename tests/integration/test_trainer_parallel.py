"""Tensor parallelism and reduced precision against the fp32 TP 1 trainer, on real Megatron code (gloo, CPU).

* TP 2 vs TP 1 (both architectures): the same weights (TP 1's, split with the conversion module's TP rules) and the
  same micro-batches give the same loss and, gathered back with the same rules, the same gradients; three optimizer
  steps give the same losses. Before the vocabulary-parallel cross-entropy, TP 2 took each rank's vocabulary slice
  as the whole vocabulary (an index error for targets past the slice, a wrong loss otherwise).
* fp16 and bf16 vs fp32 (same start weights, same data): loss and gradient norm over a few steps. Before the loss was
  scaled by the optimizer's grad scaler, fp16 gradients were divided by 2^32 without ever being multiplied by it:
  a gradient norm ~1e-10 of the fp32 one and a model that does not move.

Megatron runs in subprocesses (this file as a script): world 1 (TP 1, fp32/bf16/fp16) first, then world 2 (TP 2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.services import rank_group

ARCHS = {
    "llama": dict(architecture="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  head_dim=8, ffn_hidden_size=48, vocab_size=64, seq_length=64, normalization="RMSNorm",
                  norm_epsilon=1e-5, activation="swiglu", rope_base=10000.0, rope_scaling_factor=None,
                  tie_embeddings=False, add_bias_linear=False, add_qkv_bias=False, kv_channels=8,
                  transformer_impl="local", hf=None),
    "gpt-tied-bias": dict(architecture="gpt", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                          head_dim=8, ffn_hidden_size=64, vocab_size=64, seq_length=64, normalization="LayerNorm",
                          norm_epsilon=1e-5, activation="gelu", rope_base=10000.0, rope_scaling_factor=None,
                          tie_embeddings=True, add_bias_linear=True, add_qkv_bias=False, kv_channels=8,
                          transformer_impl="local", hf=None),
}
# micro-batches of sample indices (one rank, DP 1)
MICROBATCHES = [[0, 1, 2], [3], [4, 5]]
STEPS = 3


def _run(tmp: Path, world: int, timeout: float = 420) -> None:
    rank_group([sys.executable, __file__, str(tmp)], world, timeout=timeout, what=f"world {world}")


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("parallel")
    _run(tmp, 1)
    return tmp


@pytest.fixture(scope="module")
def tp2_run(tp1_run: Path) -> Path:
    _run(tp1_run, 2)
    return tp1_run


def _rel(a, b) -> float:
    import torch

    return float((a - b).norm() / b.norm())


@pytest.mark.megatron
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_gives_the_tp1_loss_and_gradients(tp2_run: Path, arch: str) -> None:
    import torch

    from trainingrun.modeling import convert
    from trainingrun.modeling.architecture import Architecture

    ref = torch.load(tp2_run / f"tp1-{arch}.pt", weights_only=True)
    shards = [torch.load(tp2_run / f"tp2-{arch}-rank{r}.pt", weights_only=True) for r in range(2)]
    a = Architecture.from_dict(ARCHS[arch])
    names = list(ref["grads"])
    assert names and set(names) == set(shards[0]["grads"])
    worst = 0.0
    for name in names:
        dim, _ = convert.tp_layout(name, a)
        if dim is not None:  # really sharded
            assert shards[0]["grads"][name].shape[dim] * 2 == ref["grads"][name].shape[dim], name
        full = convert.gather_tp(name, [s["grads"][name] for s in shards], a) if dim is not None else \
            shards[0]["grads"][name]
        if ref["grads"][name].norm() > 0:
            worst = max(worst, _rel(full.double(), ref["grads"][name].double()))
    print(f"{arch}: TP2 vs TP1 gradient rel err {worst:.2e}; losses {shards[0]['losses']} vs {ref['losses']}")
    assert worst <= 1e-5, worst
    # the loss of the first step, then the losses of 3 optimizer steps
    for s in shards:
        assert abs(s["objective"] - ref["objective"]) <= 1e-6 * abs(ref["objective"])
        for x, y in zip(s["losses"], ref["losses"], strict=True):
            assert abs(x - y) <= 1e-5 * abs(y), (s["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0]  # the steps did train


@pytest.mark.megatron
@pytest.mark.parametrize("precision,loss_tol,gnorm_tol", [("bf16", 2e-2, 5e-2), ("fp16", 2e-3, 1e-2)])
def test_half_precisions_track_fp32(tp1_run: Path, precision: str, loss_tol: float, gnorm_tol: float) -> None:
    ref = json.loads((tp1_run / "precision-fp32.json").read_text())
    got = json.loads((tp1_run / f"precision-{precision}.json").read_text())
    print(f"{precision} vs fp32: losses {got['losses']} vs {ref['losses']}; grad norms {got['grad_norms']} vs "
          f"{ref['grad_norms']}; loss scales {got['loss_scales']}")
    assert not any(got["skipped"]), got  # no overflow at the initial fp16 scale on this model
    for step, (x, y) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(x - y) <= loss_tol * abs(y), (step, got, ref)
    for step, (x, y) in enumerate(zip(got["grad_norms"], ref["grad_norms"], strict=True)):
        assert abs(x - y) <= gnorm_tol * abs(y), (step, got, ref)
    if precision == "fp16":
        assert got["loss_scales"][0] == 2.0**16
    assert ref["losses"][-1] < ref["losses"][0]


# ---------------------------------------------------------------------------------------------- subprocess worker
def _microbatches(device, vocab: int):
    from trainingrun.contract.published import rank_payload
    from trainingrun.trainer.batch import pack
    from tests.synthetic import loss_tokens_of, make_samples

    samples = make_samples(6, vocab=vocab, seed=3, min_len=3, max_len=10, group_size=2)
    order = [i for mb in MICROBATCHES for i in mb]
    payload = rank_payload(samples, order)
    positions, p = [], 0
    for mb in MICROBATCHES:
        positions.append(list(range(p, p + len(mb))))
        p += len(mb)
    return [pack(payload, pos, device) for pos in positions], len(order), loss_tokens_of(samples, order)


def _train(arch, state: dict | None, device, steps: int = STEPS, grads_out: Path | None = None) -> dict:
    """Build (loading `state` if given), one forward/backward for gradients, then `steps` optimizer steps."""
    import torch
    from megatron.core import parallel_state

    from trainingrun.modeling.convert import canonical_names
    from trainingrun.modeling.model import build_model, load_canonical_state, set_seed
    from trainingrun.trainer.loss import LossSettings, StepTotals
    from trainingrun.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from trainingrun.trainer.step import forward_backward, train_step

    set_seed(7)
    model = build_model(arch, device)
    if state is not None:
        from trainingrun.modeling.convert import split_tp

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        load_canonical_state(model, {k: split_tp(k, v, arch, tp_rank, tp) for k, v in state.items()})
    start = {k: v.detach().clone() for k, v in canonical_names(model.state_dict()).items()}
    ddp = wrap_ddp(model)
    opt = OptimSettings(lr=3e-3, min_lr=0.0, warmup_samples=0, decay_samples=None, decay_style="constant",
                        weight_decay=0.0, clip_grad=0.0, beta1=0.9, beta2=0.999)
    optimizer, scheduler = build_optimizer(ddp, opt, arch.precision)
    mbs, gbs, loss_tokens = _microbatches(device, arch.vocab_size)
    loss = (LossSettings("sft", "sample"), StepTotals(global_batch_size=gbs, loss_tokens=loss_tokens))
    ddp.zero_grad_buffer()
    stats = forward_backward(ddp, mbs, *loss, dp_size=1)
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {names[id(p)]: p.main_grad.detach().clone() for p in model.parameters()}
    grads = canonical_names(grads)
    out = {"objective": float(stats[0, 0]), "losses": [], "grad_norms": [], "loss_scales": [], "skipped": []}
    for _ in range(steps):
        res = train_step(ddp, optimizer, scheduler, mbs, *loss, dp_size=1,
                         dp_group=parallel_state.get_data_parallel_group())
        out["losses"].append(res.loss)
        out["grad_norms"].append(res.grad_norm)
        out["loss_scales"].append(res.loss_scale)
        out["skipped"].append(res.skipped)
    out["grads"] = grads
    out["start"] = start
    return out


def _worker(tmp: str) -> None:
    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.model import init_distributed, prepare_device

    world = int(os.environ["WORLD_SIZE"])
    device = prepare_device(0)
    init_distributed(device, tp=world)
    import torch
    import torch.distributed as dist

    out = Path(tmp)
    rank = dist.get_rank()
    for name, arch in ARCHS.items():
        arch = Architecture.from_dict({**arch, "precision": "fp32"})
        if world == 1:
            res = _train(arch, None, device)
            torch.save({"grads": res["grads"], "objective": res["objective"], "losses": res["losses"]},
                       out / f"tp1-{name}.pt")
            torch.save(res["start"], out / f"start-{name}.pt")
            if name == "llama":
                for precision in ("fp32", "bf16", "fp16"):
                    r = res if precision == "fp32" else _train(arch.replace(precision=precision), res["start"], device)
                    (out / f"precision-{precision}.json").write_text(json.dumps(
                        {k: r[k] for k in ("losses", "grad_norms", "loss_scales", "skipped")}))
        else:
            start = torch.load(out / f"start-{name}.pt", weights_only=True)
            res = _train(arch, start, device)
            torch.save({"grads": res["grads"], "objective": res["objective"], "losses": res["losses"]},
                       out / f"tp2-{name}-rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1])
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
