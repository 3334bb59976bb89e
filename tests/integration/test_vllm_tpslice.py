"""The broadcast sync to a real tensor-parallel vLLM engine (issue 28 item 6): a CPU vLLM server of the tiny Llama at
`--tensor-parallel-size 2` (`--distributed-executor-backend mp`: two worker processes), fp32. The trainer's side is a
real `BroadcastSender`; each worker receives only its slice of every tensor the table cuts (`tp_slice`) and
loads it through vLLM's own loaders. Checked: each worker received about half of the model; the engine then scores
exactly as when it loads the same weights from disk (whole files, vLLM's own narrowing), and as `transformers` in
fp32 under those weights; a second sync of other weights changes them again (nothing stale from the first).
One server for the module's checks (its start takes minutes on a loaded 2-core machine). Then the whole path: a local
run (Megatron trainer, the pool) whose replica is TP 2 over two processes (`engine.vllm.nodes: 2`), by broadcast, exact
at lag 0, each worker logging the slices it received.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_vllm_e2e import check_on_policy, parity_reward, write_spec  # noqa: F401 (autouse)
from tests.localrun import finish, role_logs, start
from tests.services import free_port, make_tiny_llama, reference_logprobs, require_vllm
from trainingrun.engines.vllm.client import VLLMClient
from trainingrun.engines.vllm.sync import load_from_broadcast, load_from_disk

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

PROMPT = [5, 17, 42, 99, 123, 7, 250, 311, 64, 480, 33, 201, 77, 390, 12, 150, 222, 9, 301, 45]
FP32_TOL = 1e-3  # engine (fp32, TP 2) vs transformers (fp32), nats per token: as test_vllm_e2e's exactness checks


@pytest.fixture(scope="module")
def weights(tiny_llama_dir: Path, tmp_path_factory) -> list[Path]:
    """Two "trained" versions of the tiny Llama (its weights plus seeded noise)."""
    python = require_vllm()
    return [make_tiny_llama(python, tmp_path_factory.mktemp(f"tp-new{s}") / "model", seed=s,
                            perturb_from=tiny_llama_dir, scale=0.5) for s in (11, 12)]


@pytest.fixture(scope="module")
def tp2(tiny_llama_dir: Path, tmp_path_factory):
    from trainingrun.engines.vllm.server import VLLMServer

    server = VLLMServer(str(tiny_llama_dir), port=free_port(), python=require_vllm(), dtype="float32",
                        log_path=tmp_path_factory.mktemp("tp2") / "server.log",
                        extra_args=("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"))
    # vLLM's CPU workers bind their threads to a NUMA node each by default ("auto"): one node here, two workers
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = given or "nobind"
    try:
        server.start()
    finally:
        if given is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    try:
        seconds = server.wait_healthy(1200)
        print(f"TP-2 vLLM server healthy after {seconds:.0f} s")
        yield server
    finally:
        server.close()


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_each_worker_receives_its_slice_and_the_engine_is_exact(tp2, tiny_llama_dir: Path, weights: list[Path]):
    from trainingrun.engines.vllm.broadcast import BroadcastSender, new_group_name

    client = VLLMClient(tp2.url, timeout=300)
    assert client.world_size() == 2
    refs = reference_logprobs(require_vllm(), weights, PROMPT)
    sender = BroadcastSender(0, host="127.0.0.1", backend="gloo", dtype="float32", timeout=120,
                             bucket_bytes=256 << 10).start()  # several buckets
    try:
        for version, new in enumerate(weights, start=1):
            before = client.prompt_logprobs(PROMPT)
            snap = sender.set_weights(version, _tensors(new).items())
            result = load_from_broadcast(client, host="127.0.0.1", port=sender.port, group=new_group_name(),
                                         label=lambda v: f"v{v}", timeout=120)
            assert result["version"] == version and client.weight_version() == f"v{version}"
            workers = result["results"]
            by_bcast = client.prompt_logprobs(PROMPT)
            # (a) each worker received its half: its slices plus the small tensors that go whole (norms)
            assert sorted(w["tp_rank"] for w in workers) == [0, 1] and all(w["tp_size"] == 2 for w in workers)
            assert all(w["sliced"] >= 7 * 2 + 2 for w in workers), workers  # q/k/v/o/gate/up/down × 2, embed, head
            shares = [w["bytes"] / snap.nbytes for w in workers]
            assert all(0.45 < s < 0.55 for s in shares), (shares, snap.nbytes)
            t0 = time.monotonic()  # the sender records the transfer after the workers' answers: wait (bounded)
            while sender.transfers < version and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            assert sender.transfers == version and sender.last["version"] == version
            assert sender.last["bytes_sent"] == sum(w["bytes"] for w in workers) < 1.05 * snap.nbytes
            print(f"version {version}: model {snap.nbytes} B; per worker {[w['bytes'] for w in workers]} B "
                  f"({[round(s, 4) for s in shares]}); trainer sent {sender.last['bytes_sent']} B")
            # (b) exact: as transformers in fp32, and as vLLM's own load of the whole files
            diff = max(abs(a - b) for a, b in zip(by_bcast, refs[new]))
            moved = max(abs(a - b) for a, b in zip(by_bcast, before))
            print(f"version {version}: max |engine - transformers| {diff:.2e}; moved by the sync {moved:.3f}")
            assert moved > 0.1, "the sync did not change the engine's logprobs"
            assert diff < FP32_TOL, (diff, by_bcast, refs[new])
            load_from_disk(client, str(new), f"disk{version}")
            by_disk = client.prompt_logprobs(PROMPT)
            assert max(abs(a - b) for a, b in zip(by_disk, by_bcast)) < 1e-5, (by_disk, by_bcast)
            load_from_disk(client, str(tiny_llama_dir), "base")  # the next version starts from the base again
    finally:
        sender.close()


ROLLOUTS = 2


def test_a_run_with_a_tensor_parallel_replica_is_exact_at_lag_0_by_sliced_broadcast(tmp_path: Path,
                                                                                     tiny_llama_dir: Path):
    """The whole path: a local run (Megatron trainer, the pool) whose one engine replica is tensor parallel 2 over two
    processes (`engine.vllm.nodes: 2`, vLLM's multi-node launch), weights by `broadcast`: each worker logs that it
    received its TP rank's slices, and every step's `logprob_abs_diff` is within the fp32 tolerance at lag 0."""
    spec = write_spec(tmp_path / "tp.yaml", tiny_llama_dir, sync="broadcast", dtype="float32", rollouts=ROLLOUTS)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["rollout"]["engine"]["vllm"]["nodes"] = 2
    spec.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    code, log = finish(start(spec, out), timeout=1500)
    assert code == 0, log[-6000:] + role_logs(out)
    recs = check_on_policy(out, log, FP32_TOL, ROLLOUTS)
    print("TP-2 replica, sliced broadcast: logprob_abs_diff", [r["logprob_abs_diff"] for r in recs])
    logs = [(out / "logs" / f).read_text() for f in ("engine-0.log", "engine-0-node1.log")]
    lines = [line for text in logs for line in text.splitlines() if "[trainingrun] worker" in line]
    for rank in (0, 1):  # every version loaded (0 … ROLLOUTS − 1), each worker its own TP rank's slices
        mine = [line for line in lines if f"as TP rank {rank} of 2" in line]
        assert len(mine) >= ROLLOUTS, lines
    print("\n".join(lines[:4]))
