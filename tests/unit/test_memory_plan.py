"""The memory plan (`modeling.memory`, `api.memory`, `trainingrun plan`, `trainingrun validate`, the operator's check):
parameter counts against transformers' models and published counts, each term's rule, the refusals and what they
name, the CLI's exit codes, and the operator refusing a new run (never a running one). What the terms are worth
against real Megatron models and real trainer processes: tests/integration/test_memory_plan.py."""

from __future__ import annotations

import copy
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from trainingrun.api.memory import plan_problems, spec_plan
from trainingrun.api.models import parse_trainingrun
from trainingrun.modeling.architecture import resolve
from trainingrun.modeling.hf_config import hf_architecture, hf_config_for, read_config
from trainingrun.modeling.memory import (
    GIB,
    MIB,
    EngineSettings,
    SyncSettings,
    TrainerSettings,
    core_attention_bytes,
    engine_plan,
    layer_activation_bytes,
    memory_plan,
    parameter_count,
    trainer_parameters,
    trainer_plan,
)

ROOT = Path(__file__).resolve().parents[2]
QWEN3_30B = ROOT / "examples" / "hf-configs" / "qwen3-30b-a3b"

MOE = dict(num_experts=8, top_k=2, ffn_hidden_size=48)
ARCHS = {
    "llama-gqa": dict(architecture="llama", num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=160, vocab_size=300, seq_length=64),
    "llama-tied": dict(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                       vocab_size=300, seq_length=64, tie_embeddings=True),
    "qwen2-bias": dict(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=96, vocab_size=300, seq_length=64, add_qkv_bias=True),
    "qwen3-qk-norm": dict(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, head_dim=32, ffn_hidden_size=96, vocab_size=300, seq_length=64,
                          qk_norm=True),
    "qwen3-moe": dict(architecture="llama", num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=300, seq_length=64, qk_norm=True,
                      moe=dict(MOE, dense_layers=(1,))),
    "qwen2-moe-shared": dict(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                             ffn_hidden_size=96, vocab_size=300, seq_length=64, add_qkv_bias=True,
                             moe=dict(MOE, shared_expert_ffn_size=80, shared_expert_gate=True)),
    "mixtral": dict(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=1,
                    ffn_hidden_size=96, vocab_size=300, seq_length=64, moe=dict(MOE, norm_topk_prob=True)),
}


# --------------------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("name", list(ARCHS))
def test_parameter_count_equals_the_transformers_model(name):
    """The independent reference: transformers builds the model from the same config.json (on the meta device)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    arch = resolve(**ARCHS[name])
    cfg = hf_config_for(arch)
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert parameter_count(arch) == sum(p.numel() for p in model.parameters())


def test_parameter_counts_of_published_models():
    assert parameter_count(resolve("llama-8b")) == 8_030_261_248  # Llama 3.1 8B
    assert parameter_count(resolve("llama-1b")) == 1_235_814_400  # Llama 3.2 1B (tied)
    arch = hf_architecture(read_config(QWEN3_30B))
    assert round(parameter_count(arch) / 1e9, 1) == 30.5  # Qwen3-30B-A3B: "30.5B in total"


@pytest.mark.parametrize("name,tp,pp,ep", [
    ("llama-gqa", 1, 1, 1), ("llama-gqa", 2, 1, 1), ("llama-gqa", 1, 3, 1), ("llama-gqa", 2, 3, 1),
    ("llama-tied", 1, 2, 1), ("llama-tied", 2, 2, 1), ("qwen3-moe", 1, 3, 2), ("qwen3-moe", 1, 1, 4),
])
def test_the_ranks_shards_add_up_to_the_model(name, tp, pp, ep):
    arch = resolve(**ARCHS[name])
    stages = [trainer_parameters(arch, tp, pp, ep, s) for s in range(pp)]
    whole = trainer_parameters(arch)
    assert sum(s.experts for s in stages) * ep == whole.experts
    dense = sum(s.dense for s in stages)
    copy_ = arch.vocab_size * arch.hidden_size if arch.tie_embeddings and pp > 1 else 0  # the last stage's copy
    if tp == 1:
        assert dense == whole.dense + copy_
    else:  # replicated: norms; split: everything else
        assert whole.dense / tp < dense < whole.dense


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 12), groups=st.sampled_from([1, 2, 4]), per_group=st.integers(1, 4),
       head_dim=st.sampled_from([8, 16]), ffn=st.integers(1, 40), vocab=st.integers(2, 500), tied=st.booleans(),
       tp=st.sampled_from([1, 2]), pp=st.integers(1, 4), tokens=st.integers(1, 4096))
def test_plan_properties(layers, groups, per_group, head_dim, ffn, vocab, tied, tp, pp, tokens):
    """For any dense llama layout the trainer runs: the stages' shards add up to the model, every term is >= 0, the
    total is the terms' sum, more tokens never need less, and the distributed optimizer never needs more."""
    layers *= pp
    heads = groups * per_group
    arch = resolve(architecture="llama", num_layers=layers, num_attention_heads=heads, num_query_groups=groups,
                   head_dim=head_dim, hidden_size=heads * head_dim, ffn_hidden_size=8 * ffn * tp,
                   vocab_size=vocab * tp, seq_length=4096, tie_embeddings=tied)
    tp = tp if groups % tp == 0 else 1  # key/value heads split over the tensor-parallel ranks
    stages = [trainer_parameters(arch, 1, pp, 1, s) for s in range(pp)]
    assert sum(s.held for s in stages) == parameter_count(arch) + (arch.vocab_size * arch.hidden_size
                                                                    if tied and pp > 1 else 0)
    base = dict(gpus_per_replica=tp * pp, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=2)
    role = trainer_plan(arch, TrainerSettings(**base, tokens=tokens))
    assert all(t.bytes >= 0 for t in role.terms) and role.total == sum(t.bytes for t in role.terms)
    assert trainer_plan(arch, TrainerSettings(**base, tokens=tokens + 64)).total >= role.total
    assert trainer_plan(arch, TrainerSettings(**base, tokens=tokens, distributed_optimizer=True)).total <= role.total


# ------------------------------------------------------------------------------------------------------- terms
def terms(plan_role):
    return {t.key: t.bytes for t in plan_role.terms}


def test_optimizer_states_by_precision_and_the_distributed_optimizer():
    fp32, bf16 = resolve("llama-1b"), resolve("llama-1b", precision="bf16")
    n = parameter_count(fp32)
    gpu = dict(gpus_per_replica=8, data_parallel=8)
    assert terms(trainer_plan(fp32, TrainerSettings(**gpu)))["optimizer"] == 8 * n  # Adam m, v
    assert terms(trainer_plan(bf16, TrainerSettings(**gpu)))["optimizer"] == 12 * n  # + fp32 main weights
    assert terms(trainer_plan(bf16, TrainerSettings(**gpu, distributed_optimizer=True)))["optimizer"] == 12 * n // 8
    t = terms(trainer_plan(bf16, TrainerSettings(**gpu)))
    assert t["weights"] == 2 * n and t["gradients"] == 4 * n
    assert terms(trainer_plan(bf16, TrainerSettings(**gpu, grad_reduce_dtype="bf16")))["gradients"] == 2 * n


def test_experts_shard_over_expert_parallel_and_their_optimizer_over_expert_data_parallel():
    arch = resolve(**ARCHS["qwen3-moe"], precision="bf16")
    plain = trainer_parameters(arch)
    shard = trainer_parameters(arch, ep=4)
    assert shard.experts * 4 == plain.experts and shard.dense == plain.dense
    s = TrainerSettings(gpus_per_replica=8, data_parallel=8, expert_parallel=4, distributed_optimizer=True)
    assert s.expert_data_parallel == 2
    opt = terms(trainer_plan(arch, s))["optimizer"]
    assert opt == shard.dense * 12 // 8 + shard.experts * 12 // 2


def test_activations_logits_and_attention_grow_with_the_token_cap_and_shrink_with_tp():
    arch = resolve("llama-1b", precision="bf16")
    small, big = (terms(trainer_plan(arch, TrainerSettings(gpus_per_replica=1, tokens=t))) for t in (2048, 8192))
    for key in ("activations", "attention", "logits"):
        assert big[key] == pytest.approx(4 * small[key], rel=1e-3)  # linear in T: no [T, T] term left
    assert small["logits"] == 2048 * arch.vocab_size * 2 + 2048 * 12
    tp2 = terms(trainer_plan(arch, TrainerSettings(gpus_per_replica=2, tensor_parallel=2, tokens=2048)))
    assert tp2["logits"] < small["logits"] / 1.9 and tp2["attention"] < small["attention"] / 1.9


def test_recompute_keeps_less():
    arch = resolve("llama-1b", precision="bf16")
    plain = terms(trainer_plan(arch, TrainerSettings(gpus_per_replica=1, tokens=4096)))
    sel = terms(trainer_plan(arch, TrainerSettings(gpus_per_replica=1, tokens=4096, recompute="selective")))
    full = terms(trainer_plan(arch, TrainerSettings(gpus_per_replica=1, tokens=4096, recompute="full")))
    block = terms(trainer_plan(arch, TrainerSettings(gpus_per_replica=1, tokens=4096, recompute="full",
                                                     recompute_method="block", recompute_num_layers=8)))
    assert sel["activations"] == plain["activations"] and sel["attention"] < plain["attention"]
    assert full["activations"] < plain["activations"] / 8 and full["attention"] == plain["attention"] / 16
    assert full["activations"] < block["activations"] < plain["activations"]


def test_pipeline_stage_zero_holds_its_micro_batches_in_flight_and_the_plan_takes_the_fullest_stage():
    arch = resolve("llama-1b", precision="bf16")
    one = trainer_plan(arch, TrainerSettings(gpus_per_replica=1, tokens=4096))
    four = trainer_plan(arch, TrainerSettings(gpus_per_replica=4, pipeline_parallel=4, tokens=4096))
    assert "stage 0 of 4" in four.note  # 4 micro-batches in flight of a quarter of the layers
    assert terms(four)["activations"] == pytest.approx(terms(one)["activations"], rel=0.02)
    assert terms(four)["logits"] == 0  # the output layer is on the last stage


def test_sync_buffers_are_two_buckets_of_generated_runs_and_at_most_the_model():
    arch = resolve("llama-1b", precision="bf16")
    t = TrainerSettings(gpus_per_replica=1)
    assert terms(trainer_plan(arch, t, SyncSettings(synced=False, bucket_mib=512)))["sync"] == 0
    assert terms(trainer_plan(arch, t, SyncSettings(synced=True, bucket_mib=512)))["sync"] == 1024 * MIB
    assert terms(trainer_plan(arch, t, SyncSettings(synced=True, bucket_mib=16384)))["sync"] == \
        parameter_count(arch) * 2
    tiny = resolve("tiny")
    assert terms(trainer_plan(tiny, t, SyncSettings(synced=True)))["sync"] == parameter_count(tiny) * 4


@pytest.mark.parametrize("lag,dtype", [(0, "bfloat16"), (2, "float32")])
def test_broadcast_snapshots_are_host_memory_sharded_over_the_owner_ranks(lag, dtype):
    """The kept versions (maxPolicyLag + 1) live in host memory, sharded over the owner ranks (issue 28 item 3): no
    GPU term; on a CPU each process holds its share (the whole / (PP × TP), plus one bucket), and not for disk."""
    arch = resolve("llama-1b", precision="bf16")
    kw = dict(synced=True, versions_kept=lag + 1, engine_dtype=dtype)
    gpu = TrainerSettings(gpus_per_replica=2, pipeline_parallel=2)
    assert "snapshots" not in terms(trainer_plan(arch, gpu, SyncSettings(type="broadcast", **kw)))
    cpu = TrainerSettings(gpus_per_replica=0, pipeline_parallel=2, tensor_parallel=2)
    plan = trainer_plan(arch, cpu, SyncSettings(type="broadcast", **kw))
    whole = (lag + 1) * parameter_count(arch) * {"bfloat16": 2, "float32": 4}[dtype]
    got = terms(plan)["snapshots"]
    assert whole / 4 <= got <= whole / 4 + SyncSettings(type="broadcast", **kw).buffers, (got, whole)
    assert "snapshots" not in terms(trainer_plan(arch, cpu, SyncSettings(type="disk", **kw)))


def test_core_attention_is_linear_and_loses_output_and_lse_with_selective_recompute():
    arch = resolve("llama-1b", precision="bf16")  # 32 heads, 8 KV heads of 64
    assert core_attention_bytes(arch, 1000) == 1000 * ((32 + 8 + 48) * 64 * 2 + 32 * 64 * 2 + 32 * 4)
    assert core_attention_bytes(arch, 1000, selective=True) == 1000 * (32 + 8 + 48) * 64 * 2
    assert layer_activation_bytes(arch, 0, tp=2) < layer_activation_bytes(arch, 0)


def test_loss_chunk_is_the_trainers():
    pytest.importorskip("torch")
    from trainingrun.modeling import memory
    from trainingrun.trainer import loss

    assert memory.LOSS_CHUNK_ELEMENTS == loss.LOSS_CHUNK_ELEMENTS


# ------------------------------------------------------------------------------------------------------ engines
def test_engine_gpu_kv_cache_is_vllms_share_less_weights_and_runtime():
    arch = resolve("llama-8b")
    e = EngineSettings(gpus=2, replicas=4, dtype="bfloat16", max_model_len=8192, gpu_memory_gib=80)
    role = engine_plan(arch, e, SyncSettings(synced=True, type="broadcast", bucket_mib=512))
    t = terms(role)
    assert role.count == 8 and role.unit == "GPU"
    assert t["weights"] == pytest.approx(parameter_count(arch) * 2 / 2, rel=0.01)
    assert t["kv"] == int(0.9 * 80 * GIB) - t["weights"] - t["runtime"]
    assert t["sync"] == 1024 * MIB and role.fits
    # --gpu-memory-utilization and the engine's GPUs decide whether one sequence's KV cache still fits
    small = engine_plan(arch, EngineSettings(gpus=1, max_model_len=131072, gpu_memory_gib=24,
                                             gpu_memory_utilization=0.9))
    assert small.fits is False
    msg = small.problem()
    assert "one sequence's KV cache" in msg and "rollout.engine.vllm.gpus" in msg and "maxModelLen" in msg


def test_cpu_engines_and_trainers_have_no_budget():
    arch = resolve("tiny-llama")
    plan = memory_plan(arch, TrainerSettings(), EngineSettings(gpus=0, kv_cache_gib=2), SyncSettings(synced=True))
    assert plan.fits is None and plan.problems() == []
    assert terms(plan.role("engine"))["kv"] == 2 * GIB


# ----------------------------------------------------------------------------------- spec, validate, plan, operator
def llama8b_fp32_on_24gib(**trainer):
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "big"},
            "spec": {"model": {"preset": "llama-8b", "precision": "fp32"},
                     "trainer": {"replicas": 1, "gpusPerReplica": 1, "maxTokensPerGPU": 4096, "gpuMemoryGiB": 24,
                                 **trainer}}}


def test_a_llama_8b_in_fp32_on_one_24_gib_gpu_is_refused_naming_the_terms_and_the_fields():
    (field, message), = plan_problems(parse_trainingrun(llama8b_fp32_on_24gib()))
    assert field == "spec.trainer.gpuMemoryGiB"
    assert message.startswith("the trainer does not fit:") and "against 24.00 GiB" in message
    for term in ("optimizer states", "weights", "gradients"):
        assert term in message
    for name in ("trainer.optimizer.distributed", "trainer.tensorParallelSize", "model.precision",
                 "trainer.gpuMemoryGiB"):
        assert name in message


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "trainingrun", *args], capture_output=True, text=True, input=stdin,
                          cwd=ROOT, timeout=120)


def test_validate_exits_78_for_a_plan_that_does_not_fit_and_1_when_the_spec_is_wrong_too(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(llama8b_fp32_on_24gib()))
    out = run_cli("validate", str(big))
    assert out.returncode == 78, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"{big}:") and "spec.trainer.gpuMemoryGiB: the trainer does not fit" in line
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(llama8b_fp32_on_24gib(replicas=0)))
    assert run_cli("validate", str(big), str(wrong)).returncode == 1
    fits = tmp_path / "fits.yaml"
    fits.write_text(yaml.safe_dump(llama8b_fp32_on_24gib(gpuMemoryGiB=256)))
    assert run_cli("validate", str(fits)).returncode == 0
    # the loader every program uses refuses it with the same line
    from trainingrun.api import ManifestError, load_trainingrun

    with pytest.raises(ManifestError) as exc:
        load_trainingrun(big)
    assert exc.value.lines == [line]


def test_plan_cli_prints_each_term_and_the_verdict(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(llama8b_fp32_on_24gib()))
    out = run_cli("plan", str(big))
    assert out.returncode == 78
    for label in ("weights", "gradients", "optimizer states", "activations", "attention (core)", "logits",
                  "sync buffers", "runtime", "DOES NOT FIT"):
        assert label in out.stdout
    data = json.loads(run_cli("plan", str(big), "--json").stdout)
    (trainer,) = data["roles"]
    assert trainer["fits"] is False and trainer["budget_gib"] == 24
    assert sum(t["bytes"] for t in trainer["terms"]) == trainer["total_bytes"]


def test_the_qwen3_30b_example_fits_its_h200s_with_its_config(tmp_path):
    out = run_cli("plan", "examples/qwen3-30b-a3b.yaml", "--hf-config", str(QWEN3_30B.relative_to(ROOT)))
    assert out.returncode == 0, out.stderr
    assert "of 140.00 (spec.trainer.gpuMemoryGiB): fits" in out.stdout
    assert "of 140.00 (spec.rollout.engine.vllm.gpuMemoryGiB): fits" in out.stdout  # generated: the vLLM pool
    missing = run_cli("plan", "examples/qwen3-30b-a3b.yaml")
    assert missing.returncode == 1 and "--hf-config" in missing.stderr
    # the same run with broadcast fits too: the kept versions are in host memory, sharded (issue 28 item 3)
    doc = yaml.safe_load((ROOT / "examples" / "qwen3-30b-a3b.yaml").read_text())
    assert doc["spec"]["rollout"]["source"]["type"] == "generate" and doc["spec"]["weightSync"]["type"] == "disk"
    doc["spec"]["weightSync"]["type"] = "broadcast"
    (tmp_path / "bcast.yaml").write_text(yaml.safe_dump(doc))
    bcast = run_cli("plan", str(tmp_path / "bcast.yaml"), "--hf-config", str(QWEN3_30B))
    assert bcast.returncode == 0 and "snapshots" not in bcast.stdout, bcast.stdout


def test_a_cpu_run_is_never_refused_and_the_plan_adds_up_its_processes():
    out = run_cli("plan", "examples/tiny.yaml")
    assert out.returncode == 0
    assert "no budget on a CPU" in out.stdout and "CPU processes of a local run" in out.stdout


def test_a_model_hf_directory_is_planned_where_its_config_is_readable(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    arch = resolve("llama-8b")
    (model / "config.json").write_text(json.dumps(hf_config_for(arch)))
    doc = llama8b_fp32_on_24gib()
    doc["spec"]["model"] = {"hf": str(model)}
    run = parse_trainingrun(doc)
    assert plan_problems(run)  # validate and the trainer's loader: read config.json
    assert plan_problems(run, read_hf=False) == []  # the operator: the directory is on the pods' volume
    assert spec_plan(run).parameters == parameter_count(arch)


def test_vllm_arguments_set_the_engines_share():
    model_dir = QWEN3_30B
    doc = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "rl"},
           "spec": {"model": {"hf": str(model_dir), "precision": "bf16"},
                    "trainer": {"replicas": 2, "gpusPerReplica": 8, "expertParallelSize": 8, "maxTokensPerGPU": 2048,
                                "gpuMemoryGiB": 140, "lossType": "policy_gradient",
                                "optimizer": {"distributed": True}},
                    "rollout": {"source": {"type": "generate", "generate": {}},
                                "engine": {"type": "vllm", "replicas": 4,
                                           "vllm": {"gpus": 2, "maxModelLen": 8192, "gpuMemoryGiB": 140,
                                                    "args": ["--gpu-memory-utilization=0.8"]}}},
                    "weightSync": {"type": "broadcast", "bucketMiB": 256}}}
    plan = spec_plan(parse_trainingrun(doc))
    engine = plan.role("engine")
    assert engine.limit == int(0.8 * 140 * GIB) and engine.count == 8 and plan.fits
    assert terms(plan.role("trainer"))["sync"] == 512 * MIB


def test_a_multi_node_engine_replica_splits_its_weights_over_gpus_times_nodes(tmp_path):
    """engine.vllm.nodes: vLLM's multi-node launch runs tensor parallelism over gpus × nodes GPUs."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for(resolve("llama-8b"))))

    def doc(nodes):
        return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "rl"},
                "spec": {"model": {"hf": str(tmp_path), "precision": "bf16"},
                         "trainer": {"gpusPerReplica": 8, "maxTokensPerGPU": 2048, "gpuMemoryGiB": 140,
                                     "lossType": "policy_gradient"},
                         "rollout": {"source": {"type": "generate", "generate": {}},
                                     "engine": {"type": "vllm", "replicas": 2,
                                                "vllm": {"gpus": 2, "nodes": nodes, "maxModelLen": 8192,
                                                         "gpuMemoryGiB": 10}}},
                         "weightSync": {"type": "broadcast", "bucketMiB": 256}}}
    one, two = (spec_plan(parse_trainingrun(doc(n))).role("engine") for n in (1, 2))
    assert one.count == 4 and two.count == 8  # replicas × gpus × nodes GPUs
    assert terms(two)["weights"] == pytest.approx(terms(one)["weights"] / 2, rel=0.01)
    assert one.fits is False and two.fits is True  # 8B in bf16 fits 10 GiB GPUs only split four ways


def test_the_operator_refuses_a_new_run_that_does_not_fit_before_any_pod_but_never_a_running_one():
    from trainingrun.operator import checks, status
    from trainingrun.operator.observe import Observed

    run = parse_trainingrun(llama8b_fp32_on_24gib())
    errors = tuple(checks.memory_errors(run))
    assert len(errors) == 1 and errors[0].startswith("spec.trainer.gpuMemoryGiB: the trainer does not fit")
    now = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    d = status.decide(run, None, Observed(memory_errors=errors), now=now)
    assert d.status["phase"] == "Failed" and not d.create
    assert "optimizer states" in d.status["message"]
    running = copy.deepcopy(status.decide(run, None, Observed(), now=now).status)
    running["phase"] = "Running"
    assert status.decide(run, running, Observed(memory_errors=errors), now=now).status["phase"] != "Failed"
