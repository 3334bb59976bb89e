"""On-policy RL with the vLLM engine end to end: `trainingrun run` with real Megatron-core trainers, a real vLLM
server on CPU (tiny Llama HF directory) and weight sync by `disk` and by `broadcast` after every rollout.

  pool       the launcher starts and supervises the run's own pool of two vLLM servers (fp32), synced by
             `broadcast` (trainer 0 sends the weights over a gloo group to each engine's worker extension, one after
             the other); engine-1 is killed after the first step and restarted alone by the launcher
  streamed   two trainer ranks that own their parts stream the weights bucket by bucket into the session's server
             (bf16): `disk` (each writes its files of an HF directory per version on the run's volume, trainer 0
             completes it, the engine reloads it) at TP 2 and PP 2, `broadcast` (each keeps and sends its part) at
             PP 2
  broadcast  the session's vLLM server (`engine.url`, bf16), trainer 0 sends the weights over a gloo group to the
             engine's worker extension
  eval       the same with rollout.eval every 2 rollouts: held-out evaluations on the vLLM engine, the final one after
             the last rollout

With maxPolicyLag 0 every rollout is generated with the weights trained on all earlier rollouts, so the trainer's
log-probabilities of the generated tokens (before its update) equal the engine's up to the engine's precision:
`logprob_abs_diff` (token-weighted mean |engine - trainer|) is the check that the engine holds the trainer's weights
after every sync. Tolerances: fp32 engine 1e-3; bf16 engine 0.1 (bf16 weights and arithmetic against the fp32
trainer: ~0.04 nats per token on this model, docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.localrun import finish, records, role_logs, start
from tests.services import metrics_ports, wait_for
from trainingrun.engines.vllm.client import VLLMClient

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(1500)]

ROLLOUTS = 3
FP32_TOL = 1e-3
BF16_TOL = 0.1
PROMPT = [5, 9, 17, 33, 65, 129]


def write_spec(path: Path, model: Path, *, sync: str, dtype: str, url: str | None = None, rollouts: int = ROLLOUTS,
               max_restarts: int = 0, replicas: int = 1, trainer: dict | None = None) -> Path:
    engine: dict = {"type": "vllm", "vllm": {"dtype": dtype, "kvCacheGib": 1, "concurrency": 8}}
    if url:
        engine["url"] = url
    if replicas != 1:
        engine["replicas"] = replicas
    doc = {
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": f"vllm-{sync}"},
        "spec": {
            "seed": 3,
            "model": {"hf": str(model), "seqLength": 64},
            "trainer": {"replicas": 1, "gpusPerReplica": 0, "maxTokensPerGPU": 1024, "lossType": "ppo",
                        "lossNormalization": "token",
                        "optimizer": {"lr": 0.01, "minLr": 0.01, "warmupSamples": 0, "clipGrad": 1.0},
                        "checkpoint": {"interval": 100, "path": "checkpoints"}},
            "rollout": {
                "source": {"type": "generate", "generate": {
                    "prompts": {"type": "synthetic", "synthetic": {"task": "copy", "minLength": 2, "maxLength": 2}},
                    "sampling": {"temperature": 1.0, "maxNewTokens": 4},
                    "reward": {"type": "function", "function": "parity_reward:reward"}}},
                "engine": engine, "maxPolicyLag": 0, "samplesPerRollout": 32, "groupSize": 8,
                "filters": {"zeroVariance": False}, "steps": {"policy": "dynamic"}, "numRollouts": rollouts,
                "maxPendingRollouts": 1},
            "weightSync": {"type": sync},
            "metrics": {"port": metrics_ports(2)},
            "failurePolicy": {"maxRestarts": max_restarts, "backoffSeconds": 0, "progressDeadlineSeconds": 900},
        },
    }
    doc["spec"]["trainer"].update(trainer or {})
    path.write_text(yaml.safe_dump(doc))
    return path


def signal_group(pid: int, sig: int) -> None:
    """`sig` to the process and, when it leads its own process group, to the group."""
    if os.getpgid(pid) == pid:
        os.killpg(pid, sig)
    else:
        os.kill(pid, sig)


REWARD_MODULE = '''
def reward(response, reference):
    """1 for an even first token: about half of every group, so every step has advantages and moves the weights
    (the copy task's own reward is ~0 for a random model, which would leave the weights where they were)."""
    return float(int(response[0]) % 2 == 0)
'''


@pytest.fixture(autouse=True)
def parity_reward(tmp_path: Path, monkeypatch):
    (tmp_path / "parity_reward.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))


def check_on_policy(out: Path, log: str, tol: float, rollouts: int = ROLLOUTS) -> list[dict]:
    recs = records(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "succeeded", log[-4000:]
    assert sorted({r["rollout"] for r in recs}) == list(range(rollouts)), log[-4000:]
    # every prompt answered exactly once: the source produced exactly rollouts x samplesPerRollout samples
    assert summary["data"]["samples_produced"] == rollouts * 32, summary["data"]
    for r in recs:
        assert r["weight_version"] == r["rollout"] and r["policy_lag"] == 0, r
        assert r["logprob_abs_diff"] <= tol, r  # the engine generated with exactly the trainer's weights
        # a step with reward variance moves the weights (the policy may learn the parity reward: then the last
        # rollouts are all-even, with no variance and no update)
        assert (r["grad_norm"] > 0) == (r["reward_std"] > 0), r
    assert recs[0]["reward_std"] > 0, recs[0]  # ~half the first, random samples are even: the first sync is news
    return recs


def test_a_pool_of_two_servers_one_of_which_dies_mid_run(tmp_path: Path, tiny_llama_dir: Path):
    """The launcher's own pool of two fp32 servers (issue 20's acceptance run), weights synced by `broadcast`
    (trainer 0's sender serves one transfer to each engine: a fan-out); engine-1 SIGKILLed after the first step: the
    launcher restarts it alone, the rollout sends its prompts to engine-0 meanwhile, loads the current version into
    engine-1 when it is back (the version barrier) and returns it to the pool; the rollout and the trainer never
    restart and nothing is lost or repeated. (Run with `broadcast` only — three vLLM start-ups, ~150 s: the pool's
    recovery is the same for both sync types; a restarted server loading by `disk` is test_vllm.py's
    test_engine_survives_a_server_restart_mid_rollout_without_losing_or_repeating_a_prompt.)"""
    sync = "broadcast"
    out = tmp_path / "run"
    rollouts = 6
    proc = start(write_spec(tmp_path / f"{sync}.yaml", tiny_llama_dir, sync=sync, dtype="float32", rollouts=rollouts,
                            max_restarts=1, replicas=2), out)
    try:
        wait_for(lambda: proc.poll() is not None or (out / "metrics.jsonl").exists() or
                 any(p.stat().st_size for p in (out / "raw").glob("*.jsonl")), 1200, "the first step")
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        processes = json.loads((out / "pids.json").read_text())["processes"]
        assert {"engine-0", "engine-1"} <= set(processes), processes
        # the trainer held (SIGSTOP) while engine-1 is down, so that the run outlasts engine-1's restart (minutes
        # on this CPU; the run takes seconds on engine-0 alone) and the later rollouts use both engines again
        trainer = processes["trainer-0"]["pid"]
        signal_group(trainer, signal.SIGSTOP)
        os.killpg(processes["engine-1"]["pid"], signal.SIGKILL)
        try:
            time.sleep(5)  # the launcher sees engine-1's exit and restarts it on its port
            engine1 = VLLMClient(processes["engine-1"]["url"], timeout=5)
            wait_for(lambda: proc.poll() is not None or engine1.healthy(), 900, "engine-1 restarted")
        finally:
            signal_group(trainer, signal.SIGCONT)
    except BaseException:
        proc.kill()
        raise
    code, log = finish(proc, timeout=1500)
    assert code == 0, log[-6000:] + role_logs(out)
    assert "2 vLLM server(s) healthy after" in log and "restarting the engine engine-1" in log, log[-4000:]
    recs = check_on_policy(out, log, FP32_TOL, rollouts)  # every step within tolerance: both engines synced
    print(f"{sync} pool: logprob_abs_diff", [r["logprob_abs_diff"] for r in recs])
    summary = json.loads((out / "summary.json").read_text())
    # one restart (engine-1's), no new attempt: the rollout and the trainer ran through
    assert summary["restarts"] == 1 and [a["attempt"] for a in summary["attempts"]] == [0], summary["attempts"]
    # both servers served requests; engine-1's log (appended over its restart) shows requests after it came back
    served = {i: (out / "logs" / f"engine-{i}.log").read_text() for i in (0, 1)}
    assert all("/v1/completions" in t for t in served.values()), {i: t[-2000:] for i, t in served.items()}
    marker = "--- trainingrun: engine-1 restart 1 ---"
    after = served[1].split(marker, 1)[1] if marker in served[1] else ""
    # re-synced (the worker extension's load) before it served again
    assert "/collective_rpc" in after and "/v1/completions" in after, served[1][-3000:]
    assert after.index("/collective_rpc") < after.index("/v1/completions"), after[-3000:]


def test_broadcast_sync_with_a_user_server(tmp_path: Path, tiny_llama_dir: Path, vllm):
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.sync import load_from_disk

    client = VLLMClient(vllm.url, timeout=120)
    before = client.prompt_logprobs(PROMPT)
    out = tmp_path / "run"
    try:
        proc = start(write_spec(tmp_path / "bc.yaml", tiny_llama_dir, sync="broadcast", dtype="bfloat16",
                                url=vllm.url), out)
        code, log = finish(proc, timeout=1200)
        assert code == 0, log[-6000:] + role_logs(out)
        recs = check_on_policy(out, log, BF16_TOL)
        print("broadcast: logprob_abs_diff", [r["logprob_abs_diff"] for r in recs])
        # the server holds the weights the last rollout was generated with, and they are not the initial ones
        assert client.weight_version() == f"v{ROLLOUTS - 1}"
        after = client.prompt_logprobs(PROMPT)
        assert max(abs(a - b) for a, b in zip(before, after)) > 1e-2, (before, after)
    finally:
        load_from_disk(client, str(tiny_llama_dir), "base")  # the session's server goes back to what it had


@pytest.mark.parametrize("sync,layout", [("disk", {"tensorParallelSize": 2}),
                                         ("broadcast", {"pipelineParallelSize": 2}),
                                         ("disk", {"pipelineParallelSize": 2})],
                         ids=["disk-tp2", "broadcast-pp2", "disk-pp2"])
def test_the_streamed_sync_is_exact_across_trainer_ranks(tmp_path: Path, tiny_llama_dir: Path, vllm, sync, layout):
    """Issue 28: the weights stream bucket by bucket from two trainer ranks (TP 2: every bucket all-gathered, each
    assembled on one of the two; PP 2: each stage keeps the buckets of its own layers) that own their parts — disk:
    each writes its own files of the version's directory; broadcast: each keeps its part of the snapshot and sends it
    in the one transfer — into the session's server, and the engine generates with exactly the trainer's weights at
    lag 0 (logprob_abs_diff within the bf16 tolerance on every step, as at one rank)."""
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.sync import load_from_disk

    client = VLLMClient(vllm.url, timeout=120)
    out = tmp_path / "run"
    try:
        spec = write_spec(tmp_path / "s.yaml", tiny_llama_dir, sync=sync, dtype="bfloat16", url=vllm.url,
                          trainer={"replicas": 2, **layout}, rollouts=2)  # the vLLM scope is the suite's longest
        doc = yaml.safe_load(spec.read_text())
        doc["spec"]["weightSync"]["bucketMiB"] = 1  # several buckets even for the tiny model
        spec.write_text(yaml.safe_dump(doc))
        code, log = finish(start(spec, out), timeout=1200)
        assert code == 0, log[-6000:] + role_logs(out)
        recs = check_on_policy(out, log, BF16_TOL, rollouts=2)
        print(sync, layout, "logprob_abs_diff", [r["logprob_abs_diff"] for r in recs])
        assert client.weight_version() == "v1"
        assert all(r["weight_sync_bytes"] > 0 for r in recs)
        if sync == "disk":  # one HF directory per version on the volume, the older ones released (lag 0: the newest)
            dirs = sorted(p.name for p in (out / "checkpoints" / "weights").iterdir())
            assert dirs == [f"v{2:08d}-a0"], dirs
    finally:
        load_from_disk(client, str(tiny_llama_dir), "base")  # the session's server goes back to what it had


EVAL_ROLLOUTS = 3


def test_evaluations_on_a_vllm_engine_include_the_final_weights(tmp_path: Path, tiny_llama_dir: Path, vllm):
    """rollout.eval with the session's server (bf16), weights by broadcast: versions 0, 2 and the final 3 evaluated;
    the final evaluation runs after the last rollout, while the trainer still waits for the end of the stream, so its
    weights reach the engine by the broadcast sync too and the server holds the final version afterwards."""
    from trainingrun.engines.vllm.sync import load_from_disk

    spec = write_spec(tmp_path / "eval.yaml", tiny_llama_dir, sync="broadcast", dtype="bfloat16", url=vllm.url,
                      rollouts=EVAL_ROLLOUTS)
    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["rollout"]["eval"] = {"intervalRollouts": 2, "numPrompts": 8, "samplesPerPrompt": 4,
                                      "prompts": {"synthetic": {"task": "reverse", "minLength": 2, "maxLength": 3}}}
    spec.write_text(yaml.safe_dump(doc))
    client = VLLMClient(vllm.url, timeout=120)
    out = tmp_path / "run"
    try:
        code, log = finish(start(spec, out), timeout=1200)
        assert code == 0, log[-6000:] + role_logs(out)
        assert len(records(out)) == EVAL_ROLLOUTS
        evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
        assert [e["weight_version"] for e in evals] == [0, 2, 3]  # 3: the final weights, after the last rollout
        assert [e["step"] for e in evals] == [0, 2, 3]
        for e in evals:
            assert (e["k"], e["prompts"], e["samples"]) == (4, 8, 32) and 0 <= e["pass_at_1"] <= e["pass_at_k"] <= 1
            assert 0 < e["response_length_mean"] <= 4 and e["rewards_failed"] == 0
            assert 0 <= e["reward_mean"] <= 1  # the run's parity reward (1 for an even first token)
        assert client.weight_version() == f"v{EVAL_ROLLOUTS}"  # the final evaluation's weights, sent by broadcast
        print("vllm eval:", [(e["weight_version"], e["reward_mean"], e["pass_at_k"], round(e["seconds"], 2))
                             for e in evals])
    finally:
        load_from_disk(client, str(tiny_llama_dir), "base")  # the session's server goes back to what it had
