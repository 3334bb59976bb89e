"""The vLLM pieces that need no server: weight packing for broadcast, the completeness check, the server command and
the worker extension's files (tests/integration/test_vllm.py runs them against a real vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainingrun.engines.vllm.broadcast import pack
from trainingrun.engines.vllm.server import EXTENSION_CLS, extension_files, server_args, server_env, write_extension
from trainingrun.engines.vllm.worker_ext import check_complete, read_header, split_buckets


def _named():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 4, generator=g)), ("b.bias", torch.randn(5, generator=g)),
            ("c.weight", torch.randn(2, 2, 2, generator=g)), ("ids", torch.arange(6).reshape(2, 3)),
            ("d.weight", torch.randn(7, generator=g))]


@pytest.mark.parametrize("bucket_bytes", [1, 40, 1 << 20])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_pack_and_split_round_trip(bucket_bytes, dtype):
    named = _named()
    snap = pack(3, named, dtype=dtype, device="cpu", bucket_bytes=bucket_bytes)
    assert snap.manifest["version"] == 3
    assert sum(b.numel() * b.element_size() for b in snap.buckets) == snap.nbytes == snap.manifest["bytes"]
    if bucket_bytes == 1:  # every tensor its own bucket
        assert len(snap.buckets) == len(named)
    # what a receiver gets: buffers of the announced dtypes and sizes, filled by the broadcast
    received = [torch.empty(n, dtype=getattr(torch, d)) for d, n in snap.manifest["buckets"]]
    for dst, src in zip(received, snap.buckets):
        dst.copy_(src)
    out = dict(split_buckets(snap.manifest, received))
    assert sorted(out) == sorted(n for n, _ in named)
    for name, t in named:
        want = t.to(torch.bfloat16) if dtype and t.is_floating_point() else t
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name


def test_pack_copies_so_training_may_continue():
    t = torch.ones(4)
    snap = pack(0, [("w", t)], dtype=None, device="cpu")
    t.add_(1)
    assert torch.equal(snap.buckets[0], torch.ones(4))


def test_split_refuses_a_manifest_that_does_not_fit_the_buffers():
    snap = pack(0, _named()[:2], dtype=None, device="cpu", bucket_bytes=1 << 20)
    short = [snap.buckets[0][:-1].clone()]
    with pytest.raises(ValueError, match="overruns bucket 0"):
        split_buckets(snap.manifest, short)
    long = [torch.cat([snap.buckets[0], torch.zeros(1)])]
    with pytest.raises(ValueError, match="bucket 0 has"):
        split_buckets(snap.manifest, long)


def test_check_complete_names_what_is_missing_extra_or_misshapen():
    ref = {"a": [2, 2], "b": [3]}
    check_complete([("a", torch.zeros(2, 2)), ("b", torch.zeros(3))], ref, "x")
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        check_complete([("a", torch.zeros(2, 2))], ref, "x")
    with pytest.raises(ValueError, match=r"unexpected \['c'\]"):
        check_complete([("a", torch.zeros(2, 2)), ("b", torch.zeros(3)), ("c", torch.zeros(1))], ref, "x")
    with pytest.raises(ValueError, match="wrong shape"):
        check_complete([("a", torch.zeros(2, 3)), ("b", torch.zeros(3))], ref, "x")


def test_read_header_gives_names_and_shapes_without_the_data(tmp_path: Path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3, 5), "y": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    assert read_header(tmp_path / "m.safetensors") == {"x": [3, 5], "y": [2]}
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(tmp_path / "bad.safetensors")


def test_server_command_and_environment():
    args = server_args("/models/m", port=8000, host="0.0.0.0", dtype="bfloat16", max_model_len=1024)
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(args[2::2], args[3::2]))
    assert pairs["--model"] == "/models/m" and pairs["--port"] == "8000" and pairs["--host"] == "0.0.0.0"
    assert pairs["--worker-extension-cls"] == EXTENSION_CLS
    env = server_env("/ext", base={"PYTHONPATH": "/other"}, omp_threads=1)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"] == "/ext:/other"


def _lora_spec(rank: int | None, lag: int = 0, engine: str = "vllm"):
    from trainingrun.api.models import TrainingRunSpec

    return TrainingRunSpec.model_validate({
        "model": {"hf": "/models/m"}, "trainer": {"maxTokensPerGPU": 64, **({"lora": {"rank": rank}} if rank else {})},
        "rollout": {"source": {"type": "generate", "generate": {}}, "engine": {"type": engine}, "maxPolicyLag": lag},
        "weightSync": {"type": "disk" if engine == "vllm" else "store"}})


def test_lora_server_flags_hold_the_rank_and_the_versions_kept():
    from trainingrun.engines.vllm.server import lora_args

    assert lora_args(_lora_spec(None)) == []
    assert lora_args(_lora_spec(4)) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                                        "--max-cpu-loras", "2"]
    assert lora_args(_lora_spec(16, lag=2))[1:5] == ["--max-lora-rank", "16", "--max-loras", "4"]
    assert lora_args(_lora_spec(300))[2] == "320"
    with pytest.raises(ValueError, match=r"^trainer\.lora\.rank: 600 is above"):  # megatron's spec allows it
        lora_args(_lora_spec(600, engine="megatron"))
    with pytest.raises(Exception, match="lora-rank|vLLM serves LoRA adapters of rank"):
        _lora_spec(600)
    env = server_env(None, base={})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_worker_extension_imports_with_torch_alone(tmp_path: Path):
    """The extension runs in vLLM's environment, which lacks trainingrun's dependencies: its files must import with
    the standard library and torch only (pydantic, numpy, yaml blocked here)."""
    write_extension(tmp_path)
    assert set(extension_files()) == {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.py")}
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'pydantic', 'yaml', 'numpy'}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import importlib\n"
        "mod, _, cls = " + json.dumps(EXTENSION_CLS) + ".rpartition('.')\n"
        "ext = getattr(importlib.import_module(mod), cls)\n"
        "print(importlib.import_module(mod).__file__)\n"
        "print(ext.__module__, sorted(m for m in vars(ext) if m.startswith('trainingrun_')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == str(tmp_path / "trainingrun" / "engines" / "vllm" / "worker_ext.py")
    assert ("trainingrun.engines.vllm.worker_ext ['trainingrun_check_dir', 'trainingrun_check_files', "
            "'trainingrun_load_dir', 'trainingrun_receive_weights']") in out.stdout


# ------------------------------------------------------------------------------------- live state gather (TP 2)
def _gather_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from tests.unit.test_convert import arch_of
    from trainingrun.modeling import convert
    from trainingrun.modeling.state import gather_live_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    arch = arch_of(num_query_groups=2)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(*s, generator=g) for n, s in convert.expected_shapes(arch).items()
            if not n.endswith(".bias")}

    class Shard(torch.nn.Module):
        def state_dict(self, *a, **kw):
            return {n: convert.split_tp(n, t, arch, rank, world) for n, t in full.items()}

    got = gather_live_state(Shard(), arch, tp_group=dist.group.WORLD, tp_size=world, tp_rank=rank)
    if rank == 0:
        assert got is not None and set(got) == set(full)
        bad = [n for n in full if not torch.equal(got[n], full[n])]
        Path(out_path).write_text(json.dumps({"bad": bad, "n": len(full)}))
    else:
        assert got is None
    dist.destroy_process_group()


def test_gather_live_state_joins_tensor_parallel_shards(tmp_path: Path):
    """What the disk/broadcast publishers send: the full canonical weights gathered from TP 2 shards (SwiGLU halves
    and query groups split as the trainer holds them) equal the unsplit weights exactly."""
    import torch.multiprocessing as mp

    from tests.services import rendezvous_port

    out = tmp_path / "result.json"
    mp.spawn(_gather_worker, args=(2, rendezvous_port(), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["n"] > 5 and result["bad"] == []


def test_pack_reads_a_stream_once_and_copies_each_bucket_as_soon_as_it_is_full():
    """The streamed sync feeds `pack` a generator of tensors (issue 28): it is read once, in order, and a bucket is
    copied as soon as the next tensor would overflow it, so the stream may drop (here: overwrite) a tensor once the
    one after it was taken — at most one bucket per dtype is held as loose tensors. The snapshot equals the list's."""
    named = [(n, t.clone()) for n, t in _named() if t.is_floating_point()]
    taken: list[int] = []

    def stream():
        for i, (name, t) in enumerate(named):
            if i >= 2:
                named[i - 2][1].fill_(-7.0)  # bucket_bytes 1: every tensor alone, copied when the next came
            taken.append(i)
            yield name, t

    want = pack(1, [(n, t.clone()) for n, t in named], dtype=None, device="cpu", bucket_bytes=1)
    snap = pack(1, stream(), dtype=None, device="cpu", bucket_bytes=1)
    assert taken == list(range(len(named)))
    assert snap.manifest == want.manifest and all(torch.equal(a, b) for a, b in zip(snap.buckets, want.buckets))
    mixed = pack(1, iter(_named()), dtype=None, device="cpu", bucket_bytes=48)
    for i, b in enumerate(mixed.buckets):
        held = [t for t in mixed.manifest["tensors"] if t[3] == i]
        assert b.numel() * b.element_size() <= 48 or len(held) == 1


@pytest.mark.parametrize("keep", [1, 2])
def test_the_sender_lets_the_oldest_version_go_before_it_packs_the_next(keep):
    """Issue 28: with keep_versions (maxPolicyLag + 1) snapshots held, the one a new version pushes out is let go
    before the new one is packed — the sender holds at most keep_versions snapshots at any time, not one more."""
    from trainingrun.engines.vllm.broadcast import BroadcastSender

    sender = BroadcastSender(0, host="127.0.0.1", timeout=10, dtype=None, keep_versions=keep)
    try:
        seen: list[list[int]] = []

        def stream(version):
            seen.append(sender.versions)
            yield "w", torch.full((4,), float(version))

        for v in range(4):
            sender.set_weights(v, stream(v))
        assert seen == ([[], [0], [1], [2]] if keep == 2 else [[], [], [], []])
        assert sender.versions == list(range(4 - keep, 4))
        sender.set_weights(3, stream(3))  # the same version again replaces itself, keeps the others
        assert sender.versions == list(range(4 - keep, 4))
    finally:
        sender.close()
