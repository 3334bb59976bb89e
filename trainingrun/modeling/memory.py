"""The memory plan of a run: what each process holds, per GPU (per process on a CPU), term by term — THE one
function (`memory_plan`) that `trainingrun plan`, `trainingrun validate` (and so every manifest loader) and the
operator use (through `trainingrun.api.memory`, which turns a spec into the plain values below). No torch: the API
and the operator call it for free.

Trainer, per GPU (the fullest pipeline stage; per process on a CPU), for the parameters P this rank holds (its
tensor-, pipeline- and expert-parallel shard, `trainer_parameters`), b = bytes of model.precision:
  weights        P · b
  gradients      P · 4 (Megatron DDP's fp32 gradient buffer, `grad_reduce_in_fp32`), P · 2 with gradReduceDtype bf16
  optimizer      Adam's two fp32 moments (8 B) per trainable parameter, plus the fp32 main copy (4 B) of a bf16/fp16
                 model; with optimizer.distributed divided over the data-parallel group (the experts over their
                 expert-data-parallel group)
  activations    what the layers keep for the backward at the token cap T (maxTokensPerGPU, or microBatchSize ×
                 seqLength), counted tensor by tensor for the local layer spec (`layer_activation_bytes`; checked
                 against the tensors a real Megatron model saves: tests/integration/test_memory_plan.py), times the
                 micro-batches a pipeline stage holds in flight (1F1B: P − stage), less what activation recompute
                 drops; plus the final norm's and the output layer's inputs
  attention      what the core attention keeps beyond its inputs (`core_attention_bytes`): sdpa (one fused call per
                 packed document), flash and te keep q, k, v, the output and a float32 log-sum-exp per head and token,
                 linear in T (before issue 28 sdpa kept [heads, T, T] float32 scores per layer)
  logits         T · V/tp · b (kept until the loss's backward writes their gradient in place)
  temporaries    the largest short-lived allocation at the peak: the loss's float32 chunks (trainer/loss.py,
                 LOSS_TEMPORARIES (+1 with the entropy) × [LOSS_CHUNK_ELEMENTS / (V/tp) rows, V/tp]) or one
                 layer's backward (its activation gradients and the largest weight gradient before it joins the
                 buffer), whichever is larger
  reference      ppo with klCoef > 0: the initial policy's weights (P · b) and its logits
  sync buffers   generated rollouts: two buckets of weightSync.bucketMiB (the streamed weight sync's bound), or
                 the whole model where it is smaller
  snapshots      broadcast, on a CPU process: its share of maxPolicyLag + 1 models in engine.vllm.dtype, sharded
                 over the owner ranks in host memory (+ a bucket); none on a GPU (issue 28 item 3)
  runtime        what the process holds before the model: on a CPU torch, megatron-core, gloo and the trainer's
                 modules (CPU_TRAINER_RUNTIME, measured); on a GPU the CUDA context, NCCL and the allocator's slack
                 (GPU_TRAINER_RUNTIME, an estimate)
Engine (the run's own vLLM servers), per GPU of each (gpus: its tensor-parallel size, engine.vllm.gpus × nodes):
  weights        parameters / gpus · bytes of engine.vllm.dtype (norms replicated)
  runtime        CUDA context and graphs (ENGINE_GPU_CONTEXT) and the activations of vLLM's profile run
                 (--max-num-batched-tokens tokens, the sampler's float32 logits for --max-num-seqs sequences)
  KV cache       what vLLM gives the cache: gpu-memory-utilization × gpuMemoryGiB less the two above; it must hold
                 at least one sequence of maxModelLen (2 · layers · KV heads per GPU · head_dim · bytes per token)
  sync buffers   disk and broadcast syncs: two buckets of weightSync.bucketMiB (at most the model), outside vLLM's
                 share
On a CPU an engine is one server (API server + engine core processes): weights + engine.vllm.kvCacheGib +
CPU_ENGINE_RUNTIME (measured).

Budgets: spec.trainer.gpuMemoryGiB and spec.rollout.engine.vllm.gpuMemoryGiB per GPU. CPU processes have none: the
plan gives their figures and does not refuse (a spec is validated on one machine and runs on another; locally the
`plan` command prints the sum beside this machine's memory).

What it does not count: the rollout process (its in-process megatron engine included), engines the user runs
(engine.url), host memory of versions kept for lagging engines, checkpoint writing, and the optimizer step's own
temporaries (torch's AdamW on a CPU works tensor by tensor; the GPU images' fused Adam has none).

LoRA (`spec.trainer.lora`, `lora_parameters`): the base is held, frozen (no gradient buffer, no optimizer state,
no weight gradient in the backward), and the adapters are held and trained, so the weights term grows by the
adapters and the gradient and optimizer terms count the adapters alone. Target `experts` (`expert_lora_parameters`):
every local expert of an MoE layer holds its own adapters, r·(hidden + 2·moe_ffn) on linear_fc1 (SwiGLU) and
r·(moe_ffn + hidden) on linear_fc2, counted with the experts (their optimizer state shards over the experts'
data-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.lora_targets import EXPERT_LAYERS, LAYERS, expert_parts, parts

GIB = 1 << 30
MIB = 1 << 20

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ENGINE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# trainer/loss.py's chunk (2^24 float32 elements per temporary; a test keeps the two equal) and the temporaries of
# that size alive at once in its backward: 4 (measured on the CPU: a trainer's peak rises by 4 chunks in the loss's
# backward), one more with the entropy (generated rollouts; benchmarks/loss_memory.py: 0.31 GiB = 4.9 chunks).
LOSS_CHUNK_ELEMENTS = 1 << 24
LOSS_TEMPORARIES = 4
# What a trainer process holds besides the model's terms. CPU: measured on this project's machine (torch 2.13 CPU,
# megatron-core 0.16.1, gloo; tests/integration/test_memory_plan.py keeps the whole plan within 25 % of measured
# peaks). GPU: an estimate (no GPU was lent to issue 28): CUDA context ~0.5 GiB, NCCL buffers, allocator slack.
CPU_TRAINER_RUNTIME = 440 * MIB
GPU_TRAINER_RUNTIME = 2 * GIB
# A vLLM server on a CPU (API server + engine core, docs/vllm.md: ~1.4 GB for the tiny test model beside its KV
# cache); on a GPU the CUDA context and graphs of one worker (an estimate).
CPU_ENGINE_RUNTIME = 1400 * MIB
ENGINE_GPU_CONTEXT = 1 * GIB
# vLLM's defaults where engine.vllm.args does not set them
VLLM_GPU_MEMORY_UTILIZATION = 0.9
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
VLLM_MAX_NUM_SEQS = 256


# ------------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class TrainerSettings:
    """What the plan needs of spec.trainer (plain values; `trainingrun.api.memory` builds them from a spec)."""

    gpus_per_replica: int = 0  # 0: CPU processes
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    data_parallel: int = 1
    tokens: int = 4096  # the largest micro-batch: maxTokensPerGPU, or microBatchSize × seqLength
    token_field: str = "trainer.maxTokensPerGPU"  # the field that sets `tokens`
    distributed_optimizer: bool = False
    grad_reduce_dtype: str = "fp32"
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None
    gradient_accumulation_fusion: bool = False
    reference_model: bool = False  # ppo with klCoef > 0: the initial policy beside the trained one
    entropy: bool = False  # the loss computes per-token entropies (generated rollouts)
    gpu_memory_gib: float = 80.0
    lora_rank: int = 0  # spec.trainer.lora.rank; 0: no LoRA (every parameter trains)
    lora_targets: tuple[str, ...] = ()  # spec.trainer.lora.targets

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_replica > 0

    @property
    def expert_data_parallel(self) -> int:
        """The experts' data-parallel size (expert tensor parallelism is 1: a mixture of experts runs at TP 1)."""
        return max(1, self.data_parallel * self.tensor_parallel // self.expert_parallel)


@dataclass(frozen=True)
class EngineSettings:
    """What the plan needs of spec.rollout.engine (the run's own vLLM servers)."""

    replicas: int = 1
    gpus: int = 0  # per server: its tensor-parallel size; 0: CPU
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    kv_cache_gib: float = 2.0  # CPU: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    gpu_memory_gib: float = 80.0


@dataclass(frozen=True)
class SyncSettings:
    """spec.weightSync, and whether weights are synced at all (generated rollouts)."""

    synced: bool = False
    type: str = "store"
    bucket_mib: int = 512
    versions_kept: int = 1  # broadcast: snapshots trainer rank 0 keeps (rollout.maxPolicyLag + 1)
    engine_dtype: str = "bfloat16"  # the snapshots' dtype (rollout.engine.vllm.dtype)

    @property
    def buffers(self) -> int:
        """Sync memory of one process: two buckets (none when nothing is synced)."""
        return 2 * self.bucket_mib * MIB if self.synced else 0


# --------------------------------------------------------------------------------------------------- the result
@dataclass(frozen=True)
class Term:
    """One line of a role's plan: bytes, what they are, and the spec fields that change them."""

    key: str
    label: str
    bytes: int
    detail: str = ""
    fields: tuple[str, ...] = ()

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class RolePlan:
    """One role's memory per GPU (per process or server on a CPU) and its budget (None: not checked)."""

    role: str  # trainer | engine
    unit: str  # "GPU", "process", "server"
    count: int  # how many such units the run has
    terms: tuple[Term, ...]
    budget: int | None  # bytes; None on a CPU
    budget_field: str  # the spec field of the budget
    note: str = ""
    limit: int | None = None  # engines on a GPU: vLLM's share (gpu-memory-utilization × budget)
    within_limit: tuple[Term, ...] = ()  # what that share must hold (weights, runtime, one sequence's KV cache)
    limit_fields: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def fits(self) -> bool | None:
        if self.budget is None:
            return None
        return self.total <= self.budget and self._limit_excess() <= 0

    def term(self, key: str) -> Term:
        return next(t for t in self.terms if t.key == key)

    def _limit_excess(self) -> int:
        if self.limit is None:
            return 0
        return sum(t.bytes for t in self.within_limit) - self.limit

    def problem(self) -> str | None:
        """Why this role does not fit its budget, naming the terms that overflow and the fields that change them
        (None when it fits or is not checked)."""
        if self.fits is not False:
            return None
        if self._limit_excess() > 0:
            need = list(self.within_limit)
            return (f"an engine GPU does not fit: {_sum_line(need)} = {_gib(sum(t.bytes for t in need))} is more than "
                    f"vLLM's share of it, {_gib(self.limit)} ({self.note}); change "
                    f"{', '.join(_fields(need, self.limit_fields))}, or {self.budget_field.removeprefix('spec.')} if "
                    "the GPUs have more")
        excess = self.total - self.budget
        over, acc = [], 0
        for t in sorted(self.terms, key=lambda t: -t.bytes):
            if t.bytes <= 0:
                break
            over.append(t)
            acc += t.bytes
            if acc >= excess:
                break
        where = f" ({self.note})" if self.note else ""
        budget_field = self.budget_field.removeprefix("spec.")
        return (f"the {self.role} does not fit: {_gib(self.total)} per {self.unit}{where} against {_gib(self.budget)}, "
                f"over by {_gib(excess)}; the largest terms: {', '.join(f'{t.label} {_gib(t.bytes)}' for t in over)}; "
                f"change {', '.join(_fields(over))}, or {budget_field} if the GPUs have more")

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "unit": self.unit, "count": self.count, "note": self.note,
                "terms": [{"key": t.key, "label": t.label, "bytes": t.bytes, "gib": round(t.gib, 3),
                           "detail": t.detail, "fields": list(t.fields)} for t in self.terms],
                "total_bytes": self.total, "total_gib": round(self.total / GIB, 3),
                "budget_gib": None if self.budget is None else round(self.budget / GIB, 3),
                "budget_field": self.budget_field, "fits": self.fits, "problem": self.problem()}


@dataclass(frozen=True)
class MemoryPlan:
    roles: tuple[RolePlan, ...]
    parameters: int = 0  # the whole model's
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool | None:
        """False when a checked role does not fit; None when nothing was checked (CPU only)."""
        checked = [r.fits for r in self.roles if r.fits is not None]
        return all(checked) if checked else None

    def problems(self) -> list[tuple[str, str]]:
        """(budget field, message) per role that does not fit."""
        return [(r.budget_field, msg) for r in self.roles if (msg := r.problem())]

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    def to_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "fits": self.fits, "roles": [r.to_dict() for r in self.roles],
                "notes": list(self.notes)}


def _gib(n: int | float | None) -> str:
    return f"{(n or 0) / GIB:.2f} GiB"


def _sum_line(terms: list[Term]) -> str:
    return " + ".join(f"{t.label} {_gib(t.bytes)}" for t in terms)


def _fields(terms: list[Term], extra: tuple[str, ...] = ()) -> list[str]:
    out: list[str] = []
    for name in (f for t in terms for f in t.fields) if not extra else extra:
        if name not in out:
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class Parameters:
    """Parameters one trainer rank holds: `dense` (replicated over the data-parallel group) and `experts` (over the
    expert-data-parallel group), `largest` (the largest tensor: its gradient is a temporary of the backward), and
    which of them it trains (all of them; under LoRA the adapters only)."""

    dense: int
    experts: int
    largest: int
    trainable_dense: int
    trainable_experts: int

    @property
    def held(self) -> int:
        return self.dense + self.experts

    @property
    def trainable(self) -> int:
        return self.trainable_dense + self.trainable_experts


def _norm_params(arch: Architecture, size: int) -> int:
    return size * (2 if arch.normalization == "LayerNorm" else 1)


def layer_parameters(arch: Architecture, layer: int, tp: int = 1, expert_split: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer `layer` on one rank: tensor-parallel shards (`tp`; norms and
    row-parallel biases replicated) and 1/`expert_split` of the routed experts."""
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    qkv = (a + 2 * g) * d
    dense = _norm_params(arch, h) + h * qkv // tp + (qkv // tp if arch.qkv_bias else 0)
    dense += a * d * h // tp + (h if arch.add_bias_linear else 0)
    if arch.qk_norm:
        dense += 2 * d
    dense += _norm_params(arch, h)  # pre-MLP norm
    moe = arch.moe
    if moe is not None and moe.is_moe_layer(layer):
        dense += moe.num_experts * h  # the router (replicated)
        if moe.shared_expert_ffn_size:
            dense += 3 * h * moe.shared_expert_ffn_size // tp + (h if moe.shared_expert_gate else 0)
        return dense, moe.num_experts // expert_split * 3 * h * moe.ffn_hidden_size
    f = arch.ffn_hidden_size
    up = (2 if arch.gated else 1) * f
    dense += h * up // tp + f * h // tp
    if arch.add_bias_linear:
        dense += up // tp + h
    return dense, 0


def trainer_parameters(arch: Architecture, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> Parameters:
    """The parameters trainer rank of pipeline stage `stage` holds (embedding on the first stage; final norm and
    output layer on the last, which with tied embeddings and pp > 1 keeps its own copy of the embedding)."""
    per_stage = arch.num_layers // pp
    dense = experts = 0
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        d, e = layer_parameters(arch, layer, tp, ep)
        dense, experts = dense + d, experts + e
    vocab = arch.vocab_size * arch.hidden_size // tp
    largest = max(arch.hidden_size * (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim // tp,
                  arch.hidden_size * (2 if arch.gated else 1) * arch.ffn_hidden_size // tp)
    if stage == 0:
        dense += vocab
        largest = max(largest, vocab)
    if stage == pp - 1:
        dense += _norm_params(arch, arch.hidden_size)
        if not arch.tie_embeddings or pp > 1:
            dense += vocab
        largest = max(largest, vocab)
    return Parameters(dense=dense, experts=experts, largest=largest, trainable_dense=dense, trainable_experts=experts)


def lora_parameters(arch: Architecture, rank: int, targets: tuple[str, ...], tp: int = 1, pp: int = 1,
                    stage: int = 0) -> tuple[int, int]:
    """(adapter parameters, the largest adapter) one trainer rank of pipeline stage `stage` holds under LoRA
    (`modeling.lora`): per part A (r × in, split over TP in a row-parallel layer) and B (out × r, split in a
    column-parallel one); a mixture-of-experts layer has no dense MLP to adapt."""
    per_stage = arch.num_layers // pp
    total = largest = 0
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        moe_layer = arch.moe is not None and arch.moe.is_moe_layer(layer)
        for target in targets:
            if target not in LAYERS or (moe_layer and target.startswith("mlp")):
                continue
            row = LAYERS[target][1] == "row"
            for _, n_in, n_out in parts(target, arch):
                a, b = rank * (n_in // tp if row else n_in), (n_out if row else n_out // tp) * rank
                total += a + b
                largest = max(largest, a, b)
    return total, largest


def expert_lora_parameters(arch: Architecture, rank: int, targets: tuple[str, ...], pp: int = 1, ep: int = 1,
                           stage: int = 0) -> tuple[int, int]:
    """(expert adapter parameters, the largest expert adapter) one trainer rank of pipeline stage `stage` holds
    with target `experts` (module docstring): its num_experts / `ep` experts of every MoE layer of the stage."""
    if "experts" not in targets or arch.moe is None:
        return 0, 0
    per_stage = arch.num_layers // pp
    layers = sum(1 for i in range(stage * per_stage, (stage + 1) * per_stage) if arch.moe.is_moe_layer(i))
    sizes = [(rank * n_in, n_out * rank) for layer in EXPERT_LAYERS for _, n_in, n_out in expert_parts(layer, arch)]
    per_expert = sum(a + b for a, b in sizes)
    return layers * (arch.moe.num_experts // ep) * per_expert, max(max(a, b) for a, b in sizes)


def parameter_count(arch: Architecture) -> int:
    """The whole model's parameters."""
    return trainer_parameters(arch).held


# -------------------------------------------------------------------------------------------------- activations
def core_attention_bytes(arch: Architecture, tokens: int, tp: int = 1, *, selective: bool = False) -> int:
    """Bytes the core attention of one layer keeps for the backward beyond what the layer keeps anyway, at `tokens`
    packed tokens (THD): q and k (after RoPE), the fused query/key/value projection's output (v is a view of it), the
    output (one per document) and a float32 log-sum-exp per head and token — the same for sdpa (torch's fused kernel,
    one call per document), flash and te. With selective recompute the output and log-sum-exp are dropped (the
    attention runs again in the backward)."""
    b = PRECISION_BYTES[arch.precision]
    a, g, d = arch.num_attention_heads // tp, max(1, arch.num_query_groups // tp), arch.head_dim
    inputs = (a * d + g * d + (a + 2 * g) * d) * b
    if selective:
        return tokens * inputs
    return tokens * (inputs + a * d * b + 4 * a)


def norm_bytes(arch: Architecture, size: int) -> int:
    """Bytes per token a norm over `size` values keeps: torch's RMSNorm (the local spec's without apex) its float32
    input and normalised input and a float32 statistic; LayerNorm its input and two float32 statistics."""
    if arch.normalization == "RMSNorm":
        return 8 * size + 4
    return size * PRECISION_BYTES[arch.precision] + 8


def layer_activation_bytes(arch: Architecture, layer: int, tp: int = 1) -> int:
    """Bytes per token transformer layer `layer` keeps for the backward, outside its core attention
    (`core_attention_bytes`), as Megatron's local layer spec saves them: each norm (`norm_bytes`), RoPE its cos/sin, each linear layer its input, the MLP's activation (SwiGLU: 4 · ffn; GELU: ffn); a mixture of
    experts routes top-k copies of every token through experts that keep 5 · ffn (the probabilities applied in the
    activation) and the router's float32 input and logits."""
    b = PRECISION_BYTES[arch.precision]
    h, a, g, d = arch.hidden_size, arch.num_attention_heads // tp, max(1, arch.num_query_groups // tp), arch.head_dim
    out = 2 * norm_bytes(arch, h)  # input norm, pre-MLP norm
    out += h * b  # the QKV projection's input
    out += 4 * d * b  # RoPE's cos and sin for queries and keys
    if arch.qk_norm:
        out += (a + g) * norm_bytes(arch, d)  # one per query and key head
    out += a * d * b  # the output projection's input
    moe = arch.moe
    if moe is not None and moe.is_moe_layer(layer):
        k, fe = moe.top_k, moe.ffn_hidden_size
        out += 4 * h + 4 * moe.num_experts + 4 * k  # router: float32 input, logits, top-k
        out += k * (h * b + 5 * fe * b + 4 + fe * b) + 4 + 16 * k  # experts' fc1 input, activation, probs, fc2 input
        if moe.shared_expert_ffn_size:
            fs = moe.shared_expert_ffn_size // tp
            out += h * b + 5 * fs * b
        return out
    f = arch.ffn_hidden_size // tp
    out += h * b  # fc1's input
    out += (4 * f if arch.gated else f) * b + f * b  # the activation, fc2's input
    return out


# ------------------------------------------------------------------------------------------------------ trainer
_TP, _PP, _EP = "trainer.tensorParallelSize", "trainer.pipelineParallelSize", "trainer.expertParallelSize"
_DP = "trainer.replicas / trainer.gpusPerReplica (data-parallel size)"
_RECOMPUTE = "trainer.performance.recompute.granularity"


def _stage_terms(arch: Architecture, t: TrainerSettings, sync: SyncSettings, stage: int, whole: int) -> list[Term]:
    pp, tp = t.pipeline_parallel, t.tensor_parallel
    b = PRECISION_BYTES[arch.precision]
    params = trainer_parameters(arch, tp, pp, t.expert_parallel, stage)
    if t.lora_rank:  # LoRA: the base frozen (no gradient, no optimizer state), the adapters train
        adapters, biggest = lora_parameters(arch, t.lora_rank, t.lora_targets, tp, pp, stage)
        experts, biggest_expert = expert_lora_parameters(arch, t.lora_rank, t.lora_targets, pp, t.expert_parallel,
                                                         stage)
        params = Parameters(dense=params.dense + adapters, experts=params.experts + experts,
                            largest=max(biggest, biggest_expert), trainable_dense=adapters, trainable_experts=experts)
    split = (_PP, _EP) if arch.moe is not None else (_TP, _PP)  # a mixture of experts runs at TP 1
    terms = [Term("weights", "weights", params.held * b, f"{params.held:,} parameters × {b} B ({arch.precision})",
                  ("model.precision", *split))]
    gb = 4 if t.grad_reduce_dtype == "fp32" else 2
    terms.append(Term("gradients", "gradients", params.trainable * gb,
                      f"{'fp32' if gb == 4 else 'bf16'} gradient buffer, {gb} B × {params.trainable:,}",
                      (*(("trainer.performance.gradReduceDtype",) if arch.precision == "bf16" and gb == 4 else ()),
                       *split)))
    per = 8 + (4 if arch.precision != "fp32" else 0)
    shard_dense = t.data_parallel if t.distributed_optimizer else 1
    shard_experts = t.expert_data_parallel if t.distributed_optimizer else 1
    opt = params.trainable_dense * per // shard_dense + params.trainable_experts * per // shard_experts
    how = "Adam m, v" + (" + fp32 main weights" if per == 12 else "") + f", {per} B per parameter"
    if t.distributed_optimizer:
        how += f", sharded over DP {t.data_parallel}" + (
            f" (the experts over their {t.expert_data_parallel})" if params.trainable_experts else "")
    terms.append(Term("optimizer", "optimizer states", opt, how,
                      ((_DP,) if t.distributed_optimizer else ("trainer.optimizer.distributed",)) + split))
    # activations: per micro-batch, times the micro-batches this stage holds in flight (1F1B)
    T = t.tokens
    in_flight = pp - stage if pp > 1 else 1
    per_stage = arch.num_layers // pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    full = [T * layer_activation_bytes(arch, i, tp) for i in layers]
    attn = core_attention_bytes(arch, T, tp, selective=t.recompute == "selective")
    kept_input = T * arch.hidden_size * b  # a recomputed chunk keeps only its input
    if t.recompute == "full":
        n = t.recompute_num_layers or 1
        if t.recompute_method == "uniform":
            chunks = -(-len(full) // n)
            act = chunks * kept_input + sum(sorted(full)[-n:])  # one chunk recomputed at a time
            attn_total = min(n, len(full)) * attn
        else:
            n = min(n, len(full))
            act = n * kept_input + sum(full[n:]) + (max(full[:n]) if n else 0)
            attn_total = (len(full) - n + (1 if n else 0)) * attn
        how_act = f"full recompute ({t.recompute_method}, {n} layer(s))"
    else:
        act, attn_total = sum(full), len(full) * attn
        how_act = "no recompute" if t.recompute == "none" else "selective recompute"
    last = stage == pp - 1
    if last:
        act += T * (norm_bytes(arch, arch.hidden_size) + arch.hidden_size * b)  # final norm, output layer's input
    act += T * 8  # the token ids
    act_fields = (t.token_field, *((_RECOMPUTE,) if t.recompute != "full" else ()), _TP, _PP)
    terms.append(Term("activations", "activations", act * in_flight,
                      f"{per_stage} layer(s) at {T:,} tokens, {how_act}"
                      + (f", {in_flight} micro-batches in flight" if in_flight > 1 else ""), act_fields))
    terms.append(Term("attention", "attention (core)", attn_total * in_flight,
                      f"{_backend(arch, t)}: q, k, v, output, log-sum-exp; linear in tokens",
                      (t.token_field, *((_RECOMPUTE,) if t.recompute == "none" else ()), _TP)))
    vocab = arch.vocab_size // tp
    logits = T * vocab * b + T * 12 if last else 0
    terms.append(Term("logits", "logits", logits, f"{T:,} tokens × {vocab:,} vocabulary × {b} B" if last else
                      "not on this pipeline stage", (t.token_field, _TP)))
    chunk_rows = max(1, LOSS_CHUNK_ELEMENTS // max(vocab, 1))
    loss_tmp = (LOSS_TEMPORARIES + t.entropy) * min(T, chunk_rows) * vocab * 4 if last else 0
    weight_grad = 0 if t.gradient_accumulation_fusion else params.largest * b
    backward = max(full, default=0) + attn + weight_grad
    temporaries, what = (loss_tmp, "the loss's float32 chunks") if loss_tmp >= backward else (
        backward, "one layer's backward and the largest weight gradient")
    terms.append(Term("temporaries", "temporaries", temporaries, what, (t.token_field, _TP)))
    if t.reference_model:
        terms.append(Term("reference", "reference model", params.held * b + logits,
                          "ppo klCoef > 0: the initial policy's weights and logits", ("trainer.policyLoss.klCoef",)))
    buffers = min(sync.buffers, whole * b)  # two buckets, or the whole model when it is smaller
    terms.append(Term("sync", "sync buffers", buffers,
                      (f"2 buckets of {sync.bucket_mib} MiB" if buffers == sync.buffers else "the whole model (less "
                       f"than 2 buckets of {sync.bucket_mib} MiB)") if sync.synced else
                      "no weight sync (replayed rollouts)", ("weightSync.bucketMiB",) if sync.synced else ()))
    if sync.synced and sync.type == "broadcast" and not t.on_gpu:
        # the kept versions live in host memory, sharded over the owner ranks of replica 0 (every TP or EP rank of
        # every stage, issue 28 item 3): a GPU holds none; a CPU process its share, plus one bucket of imbalance
        eb = ENGINE_DTYPE_BYTES[sync.engine_dtype]
        owners = t.pipeline_parallel * (t.expert_parallel if t.expert_parallel > 1 else t.tensor_parallel)
        share = min(sync.versions_kept * whole * eb, -(-sync.versions_kept * whole * eb // owners) + sync.buffers // 2)
        terms.append(Term("snapshots", "broadcast snapshots", share,
                          f"{sync.versions_kept} × the whole model × {eb} B ({sync.engine_dtype}) / {owners} owner "
                          f"ranks (+ a bucket), rollout.maxPolicyLag + 1 versions, in host memory",
                          ("rollout.maxPolicyLag", "weightSync.type")))
    runtime = GPU_TRAINER_RUNTIME if t.on_gpu else CPU_TRAINER_RUNTIME
    terms.append(Term("runtime", "runtime", runtime, "CUDA context, NCCL, allocator (estimate)" if t.on_gpu else
                      "torch, megatron-core, gloo (measured)"))
    return terms


def _backend(arch: Architecture, t: TrainerSettings) -> str:
    if arch.attention_backend != "auto":
        return arch.attention_backend
    return "te, flash or sdpa (auto)" if t.on_gpu else "sdpa"


def trainer_plan(arch: Architecture, t: TrainerSettings, sync: SyncSettings = SyncSettings()) -> RolePlan:
    """The trainer's plan per GPU — its fullest pipeline stage — or per process on a CPU."""
    whole = parameter_count(arch)
    stages = [_stage_terms(arch, t, sync, s, whole) for s in range(t.pipeline_parallel)]
    worst = max(range(len(stages)), key=lambda s: sum(x.bytes for x in stages[s]))
    world = t.data_parallel * t.tensor_parallel * t.pipeline_parallel
    note = f"pipeline stage {worst} of {t.pipeline_parallel}, the fullest" if t.pipeline_parallel > 1 else ""
    return RolePlan("trainer", "GPU" if t.on_gpu else "process", world, tuple(stages[worst]),
                    int(t.gpu_memory_gib * GIB) if t.on_gpu else None, "spec.trainer.gpuMemoryGiB", note)


# ------------------------------------------------------------------------------------------------------- engine
_V = "rollout.engine.vllm"


def kv_bytes_per_token(arch: Architecture, gpus: int, dtype: str) -> int:
    """KV cache bytes one token takes on one engine GPU (key/value heads split over the GPUs, at least one each)."""
    g = max(1, arch.num_query_groups // max(gpus, 1))
    return 2 * arch.num_layers * g * arch.head_dim * ENGINE_DTYPE_BYTES[dtype]


def engine_plan(arch: Architecture, e: EngineSettings, sync: SyncSettings = SyncSettings()) -> RolePlan:
    """One engine GPU (engine.vllm.gpus > 0) or one CPU server of the run's own vLLM pool."""
    eb = ENGINE_DTYPE_BYTES[e.dtype]
    gpus = max(e.gpus, 1)
    params = trainer_parameters(arch, tp=gpus, ep=gpus)  # vLLM splits the experts over its tensor-parallel GPUs
    weights = Term("weights", "weights", params.held * eb, f"{params.held:,} parameters × {eb} B ({e.dtype})",
                   (f"{_V}.gpus", f"{_V}.dtype"))
    synced = sync.synced and sync.type in ("disk", "broadcast")
    buffers = Term("sync", "sync buffers", min(sync.buffers, parameter_count(arch) * eb) if synced else 0,
                   f"2 buckets of {sync.bucket_mib} MiB" if synced else "no weight sync",
                   ("weightSync.bucketMiB",) if synced else ())
    per_token = kv_bytes_per_token(arch, e.gpus, e.dtype)
    if e.gpus == 0:
        kv = Term("kv", "KV cache", int(e.kv_cache_gib * GIB),
                  f"{_V}.kvCacheGib: {int(e.kv_cache_gib * GIB) // per_token:,} tokens", (f"{_V}.kvCacheGib",))
        runtime = Term("runtime", "runtime", CPU_ENGINE_RUNTIME, "API server + engine core (measured)")
        return RolePlan("engine", "server", e.replicas, (weights, kv, runtime, buffers), None,
                        f"spec.{_V}.gpuMemoryGiB")
    vocab = arch.vocab_size // gpus
    f_act = 2 * arch.ffn_hidden_size if arch.moe is None else arch.moe.top_k * 2 * arch.moe.ffn_hidden_size
    profile = (e.max_num_batched_tokens * (4 * arch.hidden_size + f_act // gpus) * eb
               + e.max_num_seqs * vocab * 4 * 2)
    runtime = Term("runtime", "runtime", ENGINE_GPU_CONTEXT + profile,
                   f"CUDA context and graphs, the profile run ({e.max_num_batched_tokens:,} tokens, "
                   f"{e.max_num_seqs} sequences' logits); an estimate",
                   (f"{_V}.args --max-num-batched-tokens", f"{_V}.args --max-num-seqs"))
    budget = int(e.gpu_memory_gib * GIB)
    share = int(e.gpu_memory_utilization * budget)
    cache = share - weights.bytes - runtime.bytes
    one = e.max_model_len * per_token
    kv = Term("kv", "KV cache", max(cache, 0),
              f"vLLM's share less weights and runtime: {max(cache, 0) // max(one, 1):,} sequences of "
              f"{e.max_model_len:,} tokens", (f"{_V}.args --gpu-memory-utilization",))
    need = Term("kv_min", "one sequence's KV cache", one, f"{e.max_model_len:,} tokens × {per_token:,} B",
                (f"{_V}.maxModelLen",))
    note = f"gpu-memory-utilization {e.gpu_memory_utilization:g} × {e.gpu_memory_gib:g} GiB"
    return RolePlan("engine", "GPU", e.replicas * e.gpus, (weights, runtime, kv, buffers), budget,
                    f"spec.{_V}.gpuMemoryGiB", note, limit=share, within_limit=(weights, runtime, need),
                    limit_fields=(f"{_V}.gpus", f"{_V}.dtype", f"{_V}.maxModelLen",
                                  f"{_V}.args --gpu-memory-utilization"))


# ------------------------------------------------------------------------------------------------------ the plan
def memory_plan(arch: Architecture, trainer: TrainerSettings, engine: EngineSettings | None = None,
                sync: SyncSettings = SyncSettings()) -> MemoryPlan:
    """THE memory plan of a run (module docstring): the trainer's role, and the engines' when the run starts its own
    vLLM servers (`engine`)."""
    roles = [trainer_plan(arch, trainer, sync)]
    if engine is not None:
        roles.append(engine_plan(arch, engine, sync))
    return MemoryPlan(tuple(roles), parameters=parameter_count(arch))

