"""Attention backends and performance options, without Megatron in this process: which backend a device gets
(`modeling.model.attention_choice`), what is refused and how the refusal reads, how torch's varlen_attn is probed,
the flash core attention's wiring (cu_seqlens, grouped-query heads, softmax scale, THD layout) against the SDPA one
with the CUDA-only kernel replaced by a float64 reference written here, and `trainer.optim.performance_settings`.

The flash kernel itself runs on CUDA only (torch's varlen_attn calls the flash forward): these tests check our side
of the call; benchmarks/gpu_smoke.sh --throughput checks the kernel against the same math on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from trainingrun.api.spec.model import ModelSpec
from trainingrun.api.spec.trainer import TrainerSpec
from trainingrun.modeling import attention as attn
from trainingrun.modeling import model as mm
from trainingrun.modeling.architecture import Architecture, resolve
from trainingrun.modeling.attention import FlashVarlenAttention, PackedSDPAttention, VarlenKernel
from trainingrun.trainer import optim

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def arch(**kw) -> Architecture:
    base = dict(architecture="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                vocab_size=64, seq_length=64, precision="bf16")
    base.update(kw)
    return resolve(**base)


@pytest.fixture
def device_offers(monkeypatch):
    """Pretend a device with or without TransformerEngine / the flash kernel (the probes are what is replaced)."""

    def offer(*, te: bool, flash: bool) -> None:
        monkeypatch.setattr(mm, "te_unavailable", lambda device: None if te else "no TE (test)")
        monkeypatch.setattr(mm, "flash_unavailable",
                            lambda device, precision, head_dim: None if flash and precision != "fp32" else "no flash")

    return offer


# ------------------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize("te,flash,impl,precision,expected", [
    (True, True, "auto", "bf16", "te"),  # te > flash > sdpa
    (False, True, "auto", "bf16", "flash"),
    (False, False, "auto", "bf16", "sdpa"),
    (True, True, "auto", "fp32", "sdpa"),  # TE's packed kernels and flash are half precision
    (True, True, "local", "bf16", "flash"),  # the local spec: flash or sdpa
    (True, False, "local", "fp16", "sdpa"),
    (True, False, "transformer_engine", "fp32", "te"),  # TE's layer spec has only TE's attention
])
def test_auto_takes_the_first_backend_the_device_offers(device_offers, te, flash, impl, precision, expected):
    device_offers(te=te, flash=flash)
    choice = mm.attention_choice(arch(transformer_impl=impl, precision=precision), CUDA)
    assert choice.backend == expected
    assert choice.reason.startswith("auto")
    assert choice.layer_impl == ("transformer_engine" if expected == "te" else "local")
    assert mm.layer_impl(arch(transformer_impl=impl, precision=precision), CUDA) == choice.layer_impl


def test_auto_says_why_it_did_not_take_the_faster_ones(device_offers):
    device_offers(te=False, flash=False)
    reason = mm.attention_choice(arch(), CUDA).reason
    assert "no TE (test)" in reason and "no flash" in reason


@pytest.mark.parametrize("named", ["te", "flash", "sdpa"])
def test_a_named_backend_the_device_offers_is_taken(device_offers, named):
    device_offers(te=True, flash=True)
    impl = "transformer_engine" if named == "te" else "local"
    choice = mm.attention_choice(arch(attention_backend=named, transformer_impl=impl), CUDA)
    assert (choice.backend, choice.reason) == (named, "named")


def test_named_backends_unavailable_on_this_cpu_are_refused_naming_what_is_missing():
    # the real probes, on this machine's CPU (no CUDA, no TransformerEngine)
    with pytest.raises(ValueError) as err:
        mm.attention_choice(arch(attention_backend="flash"), CPU)
    assert str(err.value) == ("model.attentionBackend: flash is not available here: it runs on CUDA only (device "
                              "cpu); allowed here: sdpa or auto")
    with pytest.raises(ValueError) as err:
        mm.attention_choice(arch(attention_backend="te"), CPU)
    assert str(err.value).startswith("model.attentionBackend: te needs TransformerEngine, which is not available: "
                                     "TransformerEngine runs on CUDA only (device cpu)")
    with pytest.raises(ValueError, match="^model.transformerImpl: transformer_engine needs TransformerEngine"):
        mm.attention_choice(arch(transformer_impl="transformer_engine"), CPU)
    assert mm.attention_choice(arch(attention_backend="sdpa"), CPU).backend == "sdpa"
    auto = mm.attention_choice(arch(), CPU)
    assert auto.backend == "sdpa" and "runs on CUDA only" in auto.reason


def test_te_is_refused_where_the_package_does_not_import(device_offers, monkeypatch):
    # a CUDA device without transformer_engine: the real probe's message names the import
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)
    assert "transformer_engine package does not import" in mm.te_unavailable(CUDA)


def test_generation_does_not_refuse_flash_its_padded_batches_never_reach_the_kernel():
    choice = mm.attention_choice(arch(attention_backend="flash"), CPU, generation=True)
    assert choice.backend == "flash" and "SDPA" in choice.reason
    with pytest.raises(ValueError, match="model.attentionBackend: te needs TransformerEngine"):
        mm.attention_choice(arch(attention_backend="te"), CPU, generation=True)  # TE's spec cannot be built here


@pytest.mark.parametrize("backend,impl,field", [("te", "local", "te-attention-needs-te-layers"),
                                                ("flash", "transformer_engine", "te-layers-need-te-attention"),
                                                ("sdpa", "transformer_engine", "te-layers-need-te-attention")])
def test_contradictory_backend_and_layer_spec_are_refused_by_the_spec_and_the_architecture(backend, impl, field):
    message = ModelSpec.cel_rule(field).message
    with pytest.raises(ValueError, match=message.split(":")[0]):
        ModelSpec(preset="tiny", precision="bf16", attention_backend=backend, transformer_impl=impl)
    with pytest.raises(ValueError) as err:  # an Architecture built directly (tests, benchmarks) holds the same rule
        arch(attention_backend=backend, transformer_impl=impl)
    assert str(err.value) == message


def test_flash_in_fp32_is_refused_by_the_spec():
    with pytest.raises(ValueError, match="flash runs in bf16 or fp16"):
        ModelSpec(preset="tiny", attention_backend="flash")


def test_the_record_names_the_backend_only_when_one_is_named():
    auto = ModelSpec(preset="tiny").resolved()
    assert "attention_backend" not in auto.to_dict()  # records of existing runs (and fingerprints) unchanged
    named = ModelSpec(preset="tiny", precision="bf16", attention_backend="flash").resolved()
    assert named.to_dict()["attention_backend"] == "flash"
    assert Architecture.from_dict(named.to_dict()) == named


# --------------------------------------------------------------------------------------------- the probes
def test_this_torch_has_a_varlen_kernel_with_a_causal_window():
    kernel = attn.find_varlen_kernel()
    assert isinstance(kernel, VarlenKernel)
    assert kernel.causal == {"window_size": (-1, 0)} and kernel.takes_scale and kernel.takes_gqa


def test_an_older_varlen_signature_is_called_with_is_causal(monkeypatch):
    import torch.nn.attention.varlen as varlen

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("not called")

    monkeypatch.setattr(varlen, "varlen_attn", older)
    kernel = attn.find_varlen_kernel()
    assert kernel.causal == {"is_causal": True} and not kernel.takes_scale and not kernel.takes_gqa

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("not called")

    monkeypatch.setattr(varlen, "varlen_attn", no_causal)
    assert "neither window_size nor is_causal" in attn.find_varlen_kernel()


def test_flash_is_unavailable_for_what_its_kernels_do_not_take(monkeypatch):
    assert attn.flash_unavailable(CPU, "bf16", 64) == "it runs on CUDA only (device cpu)"
    assert "bf16 or fp16, the model is fp32" in attn.flash_unavailable(CUDA, "fp32", 64)
    assert "at most 256" in attn.flash_unavailable(CUDA, "bf16", 320)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert attn.flash_unavailable(CUDA, "bf16", 64) == ("flash kernels need compute capability 8.0 or newer "
                                                        "(Ampere); Tesla T4 has 7.5")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attn.flash_unavailable(CUDA, "bf16", 128) is None


# ------------------------------------------------------------------------- flash core attention: our wiring
def reference_varlen(calls, *, new_signature: bool):
    """A float64 stand-in for torch's varlen_attn: each document attends causally to itself, written out loop by
    loop (independent of both modules). `calls` records what the module passed."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append(dict(kw, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, kv_heads=k.shape[1]))
        if new_signature:
            assert kw.pop("window_size") == (-1, 0)
            scale = kw.pop("scale", None)
            gqa = kw.pop("enable_gqa", False)
        else:
            assert kw.pop("is_causal") is True
            scale, gqa = None, False
        assert not kw, kw
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        assert gqa or kv_heads == heads
        scale = 1 / math.sqrt(d) if scale is None else scale
        out = torch.zeros_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            for h in range(heads):
                g = h // (heads // kv_heads)
                qd, kd, vd = q[a:b, h].double(), k[a:b, g].double(), v[a:b, g].double()
                s = (qd @ kd.T) * scale
                s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
                out[a:b, h] = (torch.softmax(s, dim=-1) @ vd).to(q.dtype)
        return out

    return run


class _Cfg:
    attention_dropout = 0.0
    kv_channels = 8
    hidden_size = 32
    num_attention_heads = 4


class _Packed:
    qkv_format = "thd"

    def __init__(self, cu, max_len):
        self.cu_seqlens_q = self.cu_seqlens_kv = cu
        self.max_seqlen_q = self.max_seqlen_kv = max_len


@pytest.mark.parametrize("new_signature", [True, False])
@pytest.mark.parametrize("kv_heads,scale", [(4, None), (2, None), (1, 0.2)])
def test_flash_module_matches_the_sdpa_module_forward_and_backward(monkeypatch, new_signature, kv_heads, scale):
    calls: list[dict] = []
    fn = reference_varlen(calls, new_signature=new_signature)
    kernel = VarlenKernel(fn, {"window_size": (-1, 0)} if new_signature else {"is_causal": True},
                          takes_scale=new_signature, takes_gqa=new_signature)
    monkeypatch.setattr(FlashVarlenAttention, "kernel", kernel)
    torch.manual_seed(0)
    lens = [5, 1, 9, 3]
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    q = torch.randn(sum(lens), 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lens), kv_heads, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lens), kv_heads, 8, dtype=torch.float64, requires_grad=True)
    packed = _Packed(cu, max(lens))
    flash = FlashVarlenAttention(_Cfg(), layer_number=1, softmax_scale=scale)
    sdpa = PackedSDPAttention(_Cfg(), layer_number=1, softmax_scale=scale)
    out = flash(q, k, v, None, packed_seq_params=packed)
    ref = sdpa(q, k, v, None, packed_seq_params=packed)
    assert out.shape == ref.shape == (sum(lens), 4, 8)
    assert torch.allclose(out, ref, atol=1e-10)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, grads_ref):
        assert torch.allclose(g, r, atol=1e-10)
    (call,) = calls
    assert torch.equal(call["cu_q"], cu) and torch.equal(call["cu_k"], cu)
    assert (call["max_q"], call["max_k"]) == (9, 9)
    # grouped-query heads go to the kernel as they are where it takes enable_gqa, else repeated to the query heads
    assert call["kv_heads"] == (kv_heads if new_signature else 4)


def test_flash_module_reads_the_longest_document_when_the_caller_gave_none(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(FlashVarlenAttention, "kernel",
                        VarlenKernel(reference_varlen(calls, new_signature=True), {"window_size": (-1, 0)}, True, True))
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    q = torch.randn(9, 4, 8)
    FlashVarlenAttention(_Cfg(), layer_number=1)(q, q, q, None, packed_seq_params=_Packed(cu, None))
    assert calls[0]["max_q"] == 7


def test_flash_module_runs_padded_batches_through_sdpa_without_the_kernel(monkeypatch):
    monkeypatch.setattr(FlashVarlenAttention, "kernel", VarlenKernel(None, {}, False, False))  # must not be called
    torch.manual_seed(1)
    q, k, v = (torch.randn(6, 2, 4, 8) for _ in range(3))  # [S, B, heads, d]: generation's padded batch
    out = FlashVarlenAttention(_Cfg(), layer_number=1)(q, k, v, None)
    assert torch.equal(out, PackedSDPAttention(_Cfg(), layer_number=1)(q, k, v, None))


def test_flash_module_without_a_kernel_says_which_torch_lacks_it(monkeypatch):
    monkeypatch.setattr(FlashVarlenAttention, "kernel", None)
    monkeypatch.setattr(attn, "find_varlen_kernel", lambda: "torch 2.0 has no torch.nn.attention.varlen.varlen_attn")
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.randn(3, 4, 8)
    with pytest.raises(RuntimeError, match="model.attentionBackend flash: torch 2.0 has no"):
        FlashVarlenAttention(_Cfg(), layer_number=1)(q, q, q, None, packed_seq_params=_Packed(cu, 3))


# ------------------------------------------------------------------------ sdpa: one causal call per document
def block_diagonal_sdpa(query, key, value, cu, scale):
    """The sdpa backend before issue 28: one SDPA call over the whole packed micro-batch with the block-diagonal
    causal mask (grouped-query heads repeated): the reference the per-document calls must reproduce."""
    total, heads = query.shape[0], query.shape[1]
    mask = attn.block_causal_mask(cu, total)
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))
    k, v = (x.repeat_interleave(heads // x.shape[0], dim=0) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).contiguous()


class _SmolCfg:  # SmolLM2-135M's attention: 9 query heads, 3 key/value heads of 64
    attention_dropout = 0.0
    kv_channels = 64
    hidden_size = 576
    num_attention_heads = 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lens,tail,kv_heads", [
    ([300, 1, 500, 223], 0, 3),  # GQA, a one-token document
    ([64] * 16, 0, 9),  # many short documents, no GQA
    ([700, 20], 24, 3),  # positions past cu_seqlens[-1] form one more document
    ([5, 0, 9], 0, 1),  # an empty document (repeated offset), one key/value head
])
def test_sdpa_per_document_equals_the_block_diagonal_call_forward_and_backward(dtype, lens, tail, kv_heads):
    torch.manual_seed(0)
    total = sum(lens) + tail
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(total, 9, 64, dtype=dtype, requires_grad=True)
    k = torch.randn(total, kv_heads, 64, dtype=dtype, requires_grad=True)
    v = torch.randn(total, kv_heads, 64, dtype=dtype, requires_grad=True)
    module = PackedSDPAttention(_SmolCfg(), layer_number=1)
    out = module(q, k, v, None, packed_seq_params=_Packed(cu, max(lens)))
    ref = block_diagonal_sdpa(q, k, v, cu, module.softmax_scale)
    tol = 1e-6 if dtype == torch.float32 else 1e-12  # fp32: the fused kernel sums in another order
    assert out.shape == ref.shape == (total, 9, 64)
    assert (out - ref).abs().max() <= tol * ref.abs().max()
    w = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert (g - r).abs().max() <= tol * r.abs().max()


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("lens", [[4096], [1024] * 4, [64] * 64])
def test_sdpa_keeps_what_the_memory_plan_counts_linear_in_tokens(precision, dtype, lens):
    """What the backward keeps (every tensor saved by autograd, counted once per storage) is exactly the plan's
    `core_attention_bytes`: linear in the packed length whatever the documents (the block-diagonal call kept
    [heads, T, T] float32 scores: 9 × 4096² × 4 B = 576 MiB here)."""
    from trainingrun.modeling.memory import core_attention_bytes

    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(total, 9 + 2 * 3, 64, dtype=dtype, requires_grad=True)  # the fused projection's output
    q, k = qkv[:, :9] * 1.0, qkv[:, 9:12] * 1.0  # new tensors after RoPE
    v = qkv[:, 12:]  # a view of the fused output, as Megatron splits it
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        PackedSDPAttention(_SmolCfg(), layer_number=1)(q, k, v, None, packed_seq_params=_Packed(cu, max(lens)))
    plan_arch = resolve(architecture="llama", num_layers=1, hidden_size=576, num_attention_heads=9,
                        num_query_groups=3, head_dim=64, vocab_size=64, seq_length=4096, precision=precision)
    assert sum(saved.values()) == core_attention_bytes(plan_arch, total)


# ------------------------------------------------------------------------------------ performance options
def trainer_spec(**performance) -> TrainerSpec:
    distributed = performance.pop("distributed", False)
    return TrainerSpec(max_tokens_per_gpu=64, optimizer={"distributed": distributed}, performance=performance)


def test_default_performance_options_are_the_plain_ones():
    a = arch()
    choice = mm.attention_choice(a, CPU)
    options, ddp = optim.performance_settings(trainer_spec(), a, CPU, choice)
    assert options == mm.ModelOptions(attention=choice)
    assert ddp == optim.DDPSettings()


def test_performance_options_reach_the_model_and_ddp_settings():
    a = arch()
    choice = mm.attention_choice(a, CPU)
    options, ddp = optim.performance_settings(
        trainer_spec(distributed=True, overlapGradReduce=True, overlapParamGather=True, gradReduceDtype="bf16",
                     recompute={"granularity": "full", "method": "block", "numLayers": 3}), a, CPU, choice)
    assert (options.recompute_granularity, options.recompute_method, options.recompute_num_layers) == \
        ("full", "block", 3)
    assert ddp == optim.DDPSettings(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                                    grad_reduce_in_fp32=False)
    options, _ = optim.performance_settings(trainer_spec(recompute={"granularity": "full"}), a, CPU, choice)
    assert (options.recompute_method, options.recompute_num_layers) == ("uniform", 1)  # every layer its own chunk
    options, _ = optim.performance_settings(trainer_spec(recompute={"granularity": "selective"}), a, CPU, choice)
    assert (options.recompute_granularity, options.recompute_method, options.recompute_num_layers) == \
        ("selective", None, None)


def test_gradient_accumulation_fusion_is_refused_on_cpu_naming_the_field():
    a = arch()
    with pytest.raises(ValueError) as err:
        optim.performance_settings(trainer_spec(gradientAccumulationFusion=True), a, CPU, mm.attention_choice(a, CPU))
    assert str(err.value) == ("trainer.performance.gradientAccumulationFusion: not available here: it runs CUDA "
                              "kernels (device cpu); allowed here: false")


def test_gradient_accumulation_fusion_on_cuda_needs_apex(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "fused_weight_gradient_mlp_cuda", None)
    assert "apex's fused_weight_gradient_mlp_cuda extension does not import" in \
        optim.grad_accumulation_fusion_unavailable(CUDA)


@pytest.mark.parametrize("recompute,message", [
    ({"granularity": "full", "numLayers": 5}, "numLayers: 5 is more than the model's 4 layers; allowed: 1 to 4"),
    ({"granularity": "full", "numLayers": 3}, "numLayers: 3 does not divide the model's 4 layers"),
])
def test_recompute_layers_must_fit_the_model(recompute, message):
    a = arch()
    with pytest.raises(ValueError, match=message):
        optim.performance_settings(trainer_spec(recompute=recompute), a, CPU, mm.attention_choice(a, CPU))


def test_spec_rules_of_the_performance_options():
    with pytest.raises(ValueError, match="overlapParamGather overlaps the distributed optimizer"):
        trainer_spec(overlapParamGather=True)
    with pytest.raises(ValueError, match="recompute.numLayers is for granularity full only"):
        trainer_spec(recompute={"granularity": "selective", "numLayers": 1})
    with pytest.raises(ValueError, match="method block needs recompute.numLayers"):
        trainer_spec(recompute={"granularity": "full", "method": "block"})


# --------------------------------------------------------------------------------------- in-process engine
def test_the_engine_generates_on_a_visible_gpu(monkeypatch):
    """Regression: the in-process engine asked `prepare_device(0)`, which installs the CPU shim — and the shim
    refuses to install where CUDA is visible, so a run with the megatron engine could not start on a GPU machine."""
    from trainingrun.modeling import cpu_compat
    from trainingrun.engines import megatron as megatron_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert megatron_engine.engine_device() == CUDA
    assert not cpu_compat.installed()


# ------------------------------------------------------------------ the distributed optimizer's checkpoints
def _checkpoint(root, step: int, **meta):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(__import__("json").dumps(meta))
    (d / "COMPLETE").write_text("{}")


def test_checkpoints_of_the_other_optimizer_are_refused_before_loading(tmp_path):
    from trainingrun.trainer.checkpoint_megatron import optimizer_format_problem

    distributed = {"optimizer": "distributed", "tp_size": 1, "dp_size": 2}
    assert optimizer_format_problem(tmp_path, distributed) is None  # nothing to resume
    _checkpoint(tmp_path, 2, tp_size=1, dp_size=2)  # written before the field existed: the plain optimizer
    assert optimizer_format_problem(tmp_path, {"optimizer": "plain", "tp_size": 2, "dp_size": 1}) is None
    assert optimizer_format_problem(tmp_path, distributed) == (
        f"checkpoint {tmp_path / 'step_00000002'} holds the plain optimizer's state and this run uses the distributed "
        "one (trainer.optimizer.distributed true): the two store it differently; allowed: "
        "trainer.optimizer.distributed false, as it was written")
    _checkpoint(tmp_path, 4, optimizer="distributed", tp_size=1, dp_size=2)  # the newest decides
    assert optimizer_format_problem(tmp_path, {**distributed, "dp_size": 3}) is None  # any data-parallel size
    assert optimizer_format_problem(tmp_path, {**distributed, "tp_size": 2}) == (
        f"checkpoint {tmp_path / 'step_00000004'} holds the distributed optimizer's state at tensor-parallel 1: it "
        "loads at any data-parallel size, not at tensor-parallel 2; allowed: trainer.tensorParallelSize 1")
