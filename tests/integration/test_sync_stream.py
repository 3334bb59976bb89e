"""modeling/stream.py on real Megatron code (gloo, CPU): the streamed, bucketed gather gives exactly the tensors
`gather_live_state` gives, at TP 2, at PP 2 and at EP 2 (a mixture of experts), with buckets small enough that most hold one or a few tensors (and
every bucket within the bound unless it is a single larger tensor); and the two vLLM publishers that stream them
(issue 28 items 1 and 4): the disk publisher's directory (one safetensors file per bucket, and the index) and the
broadcast publisher's snapshot hold exactly the engine-dtype HF tensors of the whole gather; the store publisher
(issue 28 item 5): every owner writes parts, the version reads back bit-exact, a failed owner commits nothing, and the
in-process engine generates the same tokens and log-probabilities from the parts as from the whole gather; and the
LoRA sync's adapter publisher (issue 29 item 5) at TP 2, PP 2 and EP 2 (a mixture of experts with adapters on every
expert, gathered over the EP ranks and stacked as PEFT keeps them). Megatron runs in subprocesses (this file as a
script)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.services import rank_group

ARCH = dict(architecture="llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            head_dim=8, ffn_hidden_size=48, vocab_size=64, seq_length=64, normalization="RMSNorm", norm_epsilon=1e-5,
            activation="swiglu", rope_base=10000.0, rope_scaling_factor=None, tie_embeddings=False,
            add_bias_linear=False, add_qkv_bias=False, kv_channels=8, transformer_impl="local", hf=None,
            precision="fp32")
MOE_ARCH = dict(ARCH, qk_norm=True, moe=dict(num_experts=4, top_k=2, ffn_hidden_size=24, dense_layers=(0,)))
LIMIT = 6000  # bytes: a few tensors per bucket, the embedding (64 × 32 fp32 = 8 KiB) alone


def _arch(ep: int) -> dict:
    return MOE_ARCH if ep > 1 else ARCH


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "ep2"])
def test_streamed_buckets_equal_the_whole_gather(tmp_path, request, tp, pp, ep):
    import threading

    # the store sync's parts go to a real redis-server at TP 2, to a file store otherwise
    url = request.getfixturevalue("redis").url if tp > 1 else f"file://{tmp_path}/store-sync"
    received: dict = {}
    engines = threading.Thread(target=_engines, args=(tmp_path, received), daemon=True)
    engines.start()
    rank_group([sys.executable, __file__, str(tmp_path), str(tp), str(pp), str(ep)], tp * pp * ep, timeout=300,
               what=f"tp{tp}pp{pp}ep{ep}", env={"TEST_STORE_URL": url})
    engines.join(30)
    import torch

    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    buckets = torch.load(tmp_path / "buckets.pt", weights_only=True)
    assert len(buckets) > 3
    streamed: dict = {}
    for b in buckets:
        assert not set(b) & set(streamed), "a tensor in two buckets"
        streamed.update(b)
        nbytes = sum(t.numel() * t.element_size() for t in b.values())
        # over the bound only for one tensor alone — at EP 2 one local expert tensor is two global experts
        assert nbytes <= LIMIT or len({re.sub(r"\d+", "#", n) for n in b}) == 1, sorted(b)
    assert set(streamed) == set(whole)
    for name, t in whole.items():
        assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), name

    from trainingrun.modeling import convert
    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.hf_io import HFWeights

    want = {k: v.to(torch.bfloat16) for k, v in convert.megatron_to_hf(whole, Architecture.from_dict(_arch(ep))).items()}
    (directory,) = (tmp_path / "weights").glob("v*")
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) == len(buckets) and (directory / "model.safetensors.index.json").is_file(), files
    # written in parallel (issue 28 item 4): every owner rank (each TP / EP rank of each pipeline stage) wrote files
    # of its own buckets, each tensor once; a stage's files hold only its own layers
    written = [json.loads((tmp_path / f"disk-tensors-{r}.json").read_text()) for r in range(tp * pp * ep)]
    assert all(written) and sum(map(len, written)) == len(want), [len(w) for w in written]
    assert sorted(n for w in written for n in w) == sorted(want)
    for r, names in enumerate(written):
        assert {_stage(n, pp) for n in names} == {r // (tp * ep)}, (r, sorted(names))
    assert not list(directory.glob(".owner-*")), "the owners' records are not left in the version's directory"
    with HFWeights(directory) as w:
        assert sorted(w.names()) == sorted(want)
        for name, t in want.items():
            assert torch.equal(w.get(name), t), name
    # the broadcast's snapshot is sharded over the owner ranks (issue 28 item 3): each holds only its part, the
    # parts are disjoint, and together they are the whole model, bit-exact
    parts = [torch.load(tmp_path / f"snapshot-{r}.pt", weights_only=True) for r in range(tp * pp * ep)]
    assert len(parts) == tp * pp * ep, len(parts)  # every (stage, TP / EP rank) of the replica is an owner
    sent: dict = {}
    for r, part in enumerate(parts):
        assert part and len(part) < len(want), len(part)  # a part, never the whole model
        assert {_stage(n, pp) for n in part} == {r // (tp * ep)}, (r, sorted(part))  # its own stage's layers only
        assert not set(part) & set(sent), "a tensor in two owners' snapshots"
        sent.update(part)
    assert sorted(sent) == sorted(want)
    for name, t in want.items():
        assert torch.equal(sent[name], t), name
    assert sorted(torch.load(tmp_path / "assembled.pt", weights_only=True)) == sorted(want)
    # one transfer to two engines while the trainers run collectives on their main threads: every owner sends its
    # own part once, each engine gets the whole model bit-exact
    assert sorted(received) == ["e0", "e1"], received
    for got in received.values():
        assert not isinstance(got, BaseException), repr(got)
        assert sorted(n for n, _ in got) == sorted(want)
        assert all(torch.equal(t, want[n]) for n, t in got)
    sent = [json.loads((tmp_path / f"sent-{r}.json").read_text()) for r in range(tp * pp * ep)]
    assert [s["bytes_sent"] for s in sent] == [sum(t.numel() * t.element_size() for t in p.values()) for p in parts]
    assert all(s["transfers"] == 1 and s["failures"] == 0 for s in sent), sent

    _check_store_sync(tmp_path, url, whole, len(buckets), tp, pp, ep)


def _engines(tmp: Path, received: dict, count: int = 2) -> None:
    """Two engines of one pool sync (each a worker joining with the worker extension's own `receive`, a thread of
    this process) ask trainer rank 0 for version 0 once it wrote its port; `received` gets each one's tensors or
    error; then the trainers are told to go on ("received")."""
    import threading
    import time

    from trainingrun.engines.vllm.broadcast import new_group_name
    from trainingrun.engines.vllm.worker_ext import receive

    try:
        deadline = time.monotonic() + 240
        while not (tmp / "port").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        port = int((tmp / "port").read_text())

        def engine(name: str) -> None:
            req = {"host": "127.0.0.1", "port": port, "group": new_group_name(), "world_size": 2, "backend": "gloo",
                   "timeout": 60, "connect_timeout": 10, "version": 0, "joint": {"id": "sync-0", "members": count}}
            try:
                manifest, tensors, store = receive(req, rank=1, device="cpu")
                store.set(manifest["done_key"], "ok")
                received[name] = tensors
            except Exception as exc:  # noqa: BLE001 - asserted by the test
                received[name] = exc

        threads = [threading.Thread(target=engine, args=(f"e{i}",), daemon=True) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        (tmp / "received").write_text("1")


def _stage(hf_name: str, pp: int) -> int:
    """The pipeline stage (of `pp`, ARCH's layers split evenly) that holds the HF tensor `hf_name`."""
    layer = re.search(r"\.layers\.(\d+)\.", hf_name)
    if layer:
        return int(layer.group(1)) * pp // ARCH["num_layers"]
    return 0 if "embed_tokens" in hf_name else pp - 1  # the final norm and the output layer: the last stage


def _check_store_sync(tmp_path, url: str, whole: dict, buckets: int, tp: int, pp: int, ep: int) -> None:
    """The store sync (issue 28 item 5): every owner (each TP / EP rank of each pipeline stage) wrote the parts
    of the buckets it assembled; the version read back is the whole gather, bit-exact; the version whose owner 1
    failed was never committed and left nothing; at lag 0 the older versions were released. At TP 2 and EP 2 the
    in-process engine loading the parts generates exactly the tokens and log-probabilities it generates from the
    whole gather published as one blob."""
    import json
    import subprocess

    import torch

    from trainingrun.modeling.state import arrays_state_dict
    from trainingrun.store import StoreError, open_store

    written = [int((tmp_path / f"store-parts-{r}").read_text()) for r in range(tp * pp * ep)]
    assert all(written) and sum(written) == buckets, written
    store = open_store(url)
    assert store.latest_weights() == 2
    arrays, meta = store.read_weights(2)
    state = arrays_state_dict(arrays, meta["dtypes"])
    assert sorted(state) == sorted(whole) and meta["version"] == 2
    for name, t in whole.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name
    for gone in (0, 1):  # 0 released at lag 0, 1 never committed (its owner 1 failed)
        with pytest.raises(StoreError, match=f"weight version {gone} is not committed"):
            store.read_weights(gone)
    if url.startswith("redis"):
        assert store.client.keys("trainingrun:w:[01]:*") == []
    else:
        assert not list((tmp_path / "store-sync" / "weights").glob("0000000[01]"))
    # rank 0's weight_sync_bytes: the tensors' bytes of every owner's parts
    assert int((tmp_path / "store-bytes").read_text()) == sum(a.nbytes for a in arrays.values())
    store.close()
    if pp > 1:
        return
    proc = subprocess.run([sys.executable, __file__, str(tmp_path), "engine", str(ep), url], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                       "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "engine.json").read_text())
    assert got["parts"] == got["whole"] and len(got["parts"]) == 8, got


LORA_RANK = 4


def _lora_whole(name: str, shape: tuple[int, int], seed: int = 11):
    """The whole adapter tensor `name` of the LoRA tests: A as `apply_lora` draws it, B seeded by its name."""
    import torch

    from trainingrun.modeling.initialise import tensor_seed
    from trainingrun.modeling.lora import _draw_a

    if name.endswith("_A"):
        return _draw_a(name, shape, seed)
    return torch.randn(shape, generator=torch.Generator().manual_seed(tensor_seed(seed, name))) * 0.1


def _lora_expected(arch, targets) -> dict:
    """{PEFT name: whole tensor} of every adapter of `arch` under `targets`: the dense targets' (the MLP's on dense
    layers only) and each MoE layer's experts' stacked as PEFT's `target_parameters` keeps them (A: the experts'
    A one after another along the rows, B: [out, r, E] flattened to [out, r·E])."""
    import torch

    from trainingrun.modeling.lora import ADAPTER, peft_name
    from trainingrun.modeling.lora_targets import LAYERS, expert_parts, parts, peft_expert_key

    out = {}
    for layer in range(arch.num_layers):
        moe_layer = arch.moe is not None and arch.moe.is_moe_layer(layer)
        for target in targets:
            if target == "experts" or (moe_layer and target.startswith("mlp")):
                continue
            for part, n_in, n_out in parts(target, arch):
                pre = f"decoder.layers.{layer}.{LAYERS[target][0]}.{ADAPTER}.{part}"
                for name, shape in ((f"{pre}_A", (LORA_RANK, n_in)), (f"{pre}_B", (n_out, LORA_RANK))):
                    out[peft_name(name)] = _lora_whole(name, shape)
        if "experts" in targets and moe_layer:
            for fc in ("linear_fc1", "linear_fc2"):
                ((part, n_in, n_out),) = expert_parts(fc, arch)
                pre = [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}.{ADAPTER}.{part}"
                       for e in range(arch.moe.num_experts)]
                out[peft_expert_key(layer, fc, "A")] = torch.cat([_lora_whole(f"{p}_A", (LORA_RANK, n_in))
                                                                  for p in pre])
                out[peft_expert_key(layer, fc, "B")] = torch.stack(
                    [_lora_whole(f"{p}_B", (n_out, LORA_RANK)) for p in pre], -1).reshape(n_out, -1)
    return out


def _lora_targets(ep: int) -> tuple[str, ...]:
    """The four dense targets; at EP 2 (the mixture of experts) the attention's and the experts': PEFT (0.21 on
    transformers 5) reads gate_proj/up_proj/down_proj of a Qwen-MoE or Mixtral model as its experts' (its v4 -> v5
    conversion), so the dense MLP adapters of such a model's dense layers do not load in PEFT (docs/trainer.md)."""
    from trainingrun.modeling.lora_targets import DEFAULT_TARGETS

    return ("attention_qkv", "attention_out", "experts") if ep > 1 else DEFAULT_TARGETS


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "ep2"])
def test_adapter_publisher_writes_the_whole_adapters_as_a_peft_directory(tmp_path, tp, pp, ep):
    """The LoRA sync's publisher (`AdapterPublisher`, issue 29 item 5) at TP 2 and PP 2: the streamed gather with
    `adapters=True` joins each adapter's shards (B of column-, A of row-parallel layers) and stages; at EP 2 (a
    mixture of experts, target `experts` beside the four dense ones) each rank's experts' adapters; the directory
    holds exactly the whole adapters (in the engine's dtype, under PEFT's names), a PEFT config of their rank and
    alpha, and the meta its bytes and digests, and `peft.PeftModel` loads it onto the base."""
    import json

    import torch
    from safetensors.torch import load_file

    rank_group([sys.executable, __file__, str(tmp_path), str(tp), str(pp), str(ep), "lora"], tp * pp * ep,
               timeout=300, what=f"lora tp{tp}pp{pp}ep{ep}")
    from trainingrun.modeling.architecture import Architecture

    arch = Architecture.from_dict(_arch(ep))
    want = _lora_expected(arch, _lora_targets(ep))
    (directory,) = (tmp_path / "weights").glob("v*")
    got = load_file(str(directory / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", LORA_RANK, 2.0 * LORA_RANK)
    assert sorted(config["target_modules"]) == (["k_proj", "o_proj", "q_proj", "v_proj"] if ep > 1 else
                                                ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                 "v_proj"])
    assert config.get("target_parameters", []) == (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if ep > 1
                                                   else [])
    meta = json.loads((tmp_path / "meta.json").read_text())
    size = (directory / "adapter_model.safetensors").stat().st_size
    assert meta["method"] == "lora" and meta["bytes"] == size and meta["adapter_name"] == "trainingrun-v0"
    assert meta["files"]["adapter_model.safetensors"][0] == size
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from trainingrun.modeling.hf_config import hf_config_for

    hf = hf_config_for(arch, dtype="float32")
    cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_config(cfg), directory)
    names = ["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    if ep > 1:  # the experts' stacked adapters, where PEFT nests them
        names += ["base_model.model.model.layers.2.mlp.experts.base_layer.lora_B.weight",
                  "base_model.model.model.layers.3.mlp.experts.lora_A.weight"]
    for name in names:
        loaded = model.get_parameter(name.replace(".weight", ".default.weight"))
        assert torch.equal(loaded, want[name].to(torch.bfloat16).float()), name


def _seeded_model(tp: int, pp: int, ep: int):
    """A worker's start: the device and process groups of (tp, pp, ep), the test model's arch (`_arch(ep)`) and this
    rank's part of it, seeded (7). Megatron is imported only after `prepare_device` (the CPU shim)."""
    from trainingrun.modeling.model import init_distributed, prepare_device

    device = prepare_device(0)
    init_distributed(device, tp=tp, pp=pp, ep=ep)
    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.model import build_model, set_seed

    arch = Architecture.from_dict(_arch(ep))
    set_seed(7)
    return arch, build_model(arch, device)


def _lora_worker(tmp: str, tp: int, pp: int, ep: int) -> None:
    arch, model = _seeded_model(tp, pp, ep)
    import json

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainingrun.engines.vllm.publish import AdapterPublisher
    from trainingrun.modeling.convert import canonical_name, ep_global_name
    from trainingrun.modeling.lora import LoRAAdapter, apply_lora
    from trainingrun.modeling.lora_targets import LoRASettings
    from trainingrun.modeling.pipeline import whole_name
    from trainingrun.modeling.state import live_layout
    from trainingrun.store import open_store

    tp_at = (ps.get_tensor_model_parallel_rank(), tp)
    pp_at = (ps.get_pipeline_model_parallel_rank(), pp)
    ep_at = (ps.get_expert_model_parallel_rank(), ep)
    targets = _lora_targets(ep)
    apply_lora(model, arch, LoRASettings(rank=LORA_RANK, alpha=2.0 * LORA_RANK, targets=targets), seed=11, tp=tp_at,
               pp=pp_at, ep=ep_at)
    with torch.no_grad():  # B seeded by its whole name (apply_lora leaves it 0), this rank's shard
        for local, m in model.named_modules():
            if not isinstance(m, LoRAAdapter):
                continue
            for part in m.part_names:
                b = getattr(m, f"{part}_B")
                name = ep_global_name(whole_name(canonical_name(f"{local}.{part}_B"), arch, *pp_at), arch, *ep_at)
                size = tp if m.kind == "column" else 1
                whole = _lora_whole(name, (b.shape[0] * size, b.shape[1]))
                b.copy_(torch.chunk(whole, size, dim=0)[tp_at[0]] if size > 1 else whole)
    store = open_store(f"file://{tmp}/store")
    pub = AdapterPublisher(store, root=Path(tmp) / "weights", base=None, rank=dist.get_rank(), arch=arch,
                           dtype="bfloat16", max_policy_lag=0, **live_layout())
    pub.bucket_bytes = LIMIT  # several buckets
    pub.publish(0, model)
    if dist.get_rank() == 0:
        assert pub.last_bytes > 0
        (Path(tmp) / "meta.json").write_text(json.dumps(store.read_weights(0)[1]))
    dist.barrier()


def _busy_until(flag: Path, limit: float = 150.0) -> None:
    """Collectives on every trainer rank's main thread (as training runs beside a transfer) until `flag` exists on
    some rank (agreed by the collective itself) or `limit` seconds passed."""
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    while True:
        box = torch.tensor([float(flag.is_file() or time.monotonic() - t0 > limit)])
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        if box.item() > 0:
            return
        time.sleep(0.01)


def _worker(tmp: str, tp: int, pp: int, ep: int) -> None:
    arch, model = _seeded_model(tp, pp, ep)
    import torch
    import torch.distributed as dist

    from trainingrun.modeling.state import gather_live_state, live_layout
    from trainingrun.modeling.stream import iter_live_buckets

    layout = live_layout()
    layout.pop("dp_rank")
    whole = gather_live_state(model, arch, **layout)
    buckets = [{k: v.cpu() for k, v in b.items()} for b in iter_live_buckets(model, arch, LIMIT, **layout)]
    if dist.get_rank() == 0:
        torch.save(whole, Path(tmp) / "whole.pt")
        torch.save(buckets, Path(tmp) / "buckets.pt")
    else:
        assert not buckets

    from trainingrun.engines.vllm.publish import BroadcastPublisher, DiskPublisher
    from trainingrun.engines.vllm.worker_ext import split_buckets
    from trainingrun.store import open_store

    store = open_store(f"file://{tmp}/store")
    kw = dict(rank=dist.get_rank(), arch=arch, dtype="bfloat16", max_policy_lag=0, **live_layout())
    import trainingrun.modeling.hf_io as hf_io

    disk = DiskPublisher(store, root=Path(tmp) / "weights", assets_dir=None, **kw)
    disk.bucket_bytes = LIMIT  # below weightSync.bucketMiB's least (1 MiB): several files for this small model
    real, wrote = hf_io.write_part_files, []

    def spy(directory, shards, **k):  # the tensors this rank's files hold
        parts = real(directory, shards, **k)
        wrote.extend(n for p in parts for n in p["tensors"])
        return parts

    hf_io.write_part_files = spy
    disk.publish(0, model)
    hf_io.write_part_files = real
    (Path(tmp) / f"disk-tensors-{dist.get_rank()}.json").write_text(json.dumps(wrote))
    # an owner whose files cannot be written: rank 0 names it and commits nothing; no directory is left (several
    # owners: every TP / EP rank of every pipeline stage, `stream.shard_owner`)
    if disk.owners > 1 and dist.get_rank() == 1:
        def full(*_a, **_k):
            raise OSError("No space left on device (test)")

        hf_io.write_part_files = full
    try:
        disk.publish(1, model)
        failed = ""
    except RuntimeError as exc:
        failed = str(exc)
    if disk.owners > 1 and dist.get_rank() == 0:
        assert "owner 1's part failed: OSError: No space left on device (test)" in failed, failed
        assert store.latest_weights() == 0 and not list((Path(tmp) / "weights").glob("*v00000001*")), failed
    sender = BroadcastPublisher(open_store(f"file://{tmp}/store2"), host="127.0.0.1", **kw)
    sender.bucket_bytes = LIMIT
    if sender.sender is not None:
        sender.sender.bucket_bytes = LIMIT  # the snapshot's buckets too
    sender.publish(0, model)
    if sender.sender is not None:  # an owner: every rank of this one replica (stream.shard_owner)
        snap = sender.sender._snapshots[0]  # every TP / EP rank of this one replica owns part of the buckets
        held = [sum(1 for t in snap.manifest["tensors"] if t[3] == i) for i in range(len(snap.buckets))]
        assert len(snap.buckets) >= 2
        assert all(b.numel() * b.element_size() <= LIMIT or n == 1 for b, n in zip(snap.buckets, held))
        torch.save({k: v.clone() for k, v in split_buckets(snap.manifest, snap.buckets)},
                   Path(tmp) / f"snapshot-{dist.get_rank()}.pt")
        if dist.get_rank() == 0:  # the transfer's manifest names every owner's tensors
            whole_view = sender.sender.assemble(snap) if sender.sender.owners > 1 else snap
            torch.save({t[0]: torch.zeros(1) for t in whole_view.manifest["tensors"]}, Path(tmp) / "assembled.pt")
    if dist.get_rank() == 0:
        (Path(tmp) / "port.tmp").write_text(str(sender.sender.port))
        (Path(tmp) / "port.tmp").rename(Path(tmp) / "port")
    _busy_until(Path(tmp) / "received")  # the engines' transfer runs beside the trainers' own collectives
    t0 = time.monotonic()
    while sender.sender.transfers + sender.sender.failures < 1 and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    (Path(tmp) / f"sent-{dist.get_rank()}.json").write_text(json.dumps(
        {"bytes_sent": sender.sender.bytes_sent, "transfers": sender.sender.transfers,
         "failures": sender.sender.failures}))
    dist.barrier()
    sender.close()
    dist.barrier()
    _store_sync_worker(tmp, model, arch)


def _store_sync_worker(tmp: str, model, arch) -> None:
    """The store publisher (issue 28 item 5): version 0; version 1 with owner 1's part failing (several owners);
    version 2 (lag 0: 0 released); version 3 refused by rank 0's store before anything is gathered."""
    import torch.distributed as dist

    from trainingrun.engines.store_sync import StoreWeightPublisher
    from trainingrun.modeling.state import live_layout
    from trainingrun.store import IncompleteWeights, StoreError, open_store

    rank = dist.get_rank()
    pub = StoreWeightPublisher(open_store(os.environ["TEST_STORE_URL"]), rank=rank, arch=arch, max_policy_lag=0,
                               **live_layout())
    pub.bucket_bytes = LIMIT  # several parts of this small model
    pub.publish(0, model)
    parts = pub.last_parts
    if pub.owners > 1:
        write = pub.store.write_weights_part
        if rank == 1:
            def full(*_a, **_k):
                raise OSError("No space left on device (test)")

            pub.store.write_weights_part = full
        try:
            pub.publish(1, model)
            failed = ""
        except IncompleteWeights as exc:
            failed = str(exc)
        if rank == 0:
            assert "trainer owner 1 failed: OSError: No space left on device (test)" in failed, failed
            assert pub.store.latest_weights() == 0
        pub.store.write_weights_part = write
    pub.publish(2, model)
    assert pub.last_parts == parts  # the same buckets, the same owner
    total = pub.last_bytes
    # rank 0 cannot begin version 3 (its store refuses): every rank fails at once, none waits in a collective
    if rank == 0:
        def refused(version):
            raise StoreError(f"version {version} refused (test)")

        pub.store.begin_weights = refused
    try:
        pub.publish(3, model)
        raised = ""
    except (StoreError, RuntimeError) as exc:
        raised = f"{type(exc).__name__}: {exc}"
    want = "StoreError: version 3 refused (test)" if rank == 0 else \
        "RuntimeError: weight version 3: trainer rank 0 could not begin it"
    assert raised.startswith(want), raised
    (Path(tmp) / f"store-parts-{rank}").write_text(str(parts))
    if rank == 0:
        (Path(tmp) / "store-bytes").write_text(str(total))
    dist.barrier()


def _engine(tmp: str, ep: int, url: str) -> None:
    """The in-process engine on the store sync's version 2 (parts) and on the whole gather (one blob): the tokens
    and log-probabilities of the same seeded generation, for the test to compare."""
    import json

    import torch

    from trainingrun.contract.engine import Sampling
    from trainingrun.engines.megatron import MegatronEngine
    from trainingrun.modeling.architecture import Architecture
    from trainingrun.modeling.state import tensors_arrays
    from trainingrun.store import open_store

    arch = Architecture.from_dict(_arch(ep))
    blob = open_store(f"file://{tmp}/store-blob")
    arrays, dtypes = tensors_arrays(torch.load(Path(tmp) / "whole.pt", weights_only=True))
    blob.publish_weights(2, arrays, {"dtypes": dtypes})
    out = {}
    for name, store in (("parts", open_store(url)), ("whole", blob)):
        engine = MegatronEngine(arch, fetch=store.read_weights, seed=3, max_batch=8)
        engine.load_weights(2)
        groups = engine.generate([[1, 2, 3, 4], [5, 6, 7, 8, 9]], 4, Sampling(max_new_tokens=6, seed=1))
        out[name] = [[c.tokens.tolist() if hasattr(c.tokens, "tolist") else list(c.tokens),
                      [float(x) for x in c.logprobs]] for g in groups for c in g]
    (Path(tmp) / "engine.json").write_text(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[2] == "engine":
        _engine(sys.argv[1], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[5:] == ["lora"]:
        _lora_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
