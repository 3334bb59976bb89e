"""Multi-turn episodes in the rollout loop (`rollout.source.generate.environment`, rollout/episodes.py) against a
real file store, with a stand-in engine (the real engines: test_episodes_megatron.py, test_vllm_episodes.py) and the
environments in real worker processes.

  token in, token out   every model token of every sample is what the engine returned for exactly the context before
                        it (loss mask 1, its log-probability bit for bit); every environment token has mask 0
  per-turn samples      a group holds a variable number of samples; the scheduler never splits one
  faulty environments   hang, raise, non-text, oversized, exit, out of memory: counted by reason, the rollout goes on
                        within the timeouts, every episode is accounted for
  restart               a rollout SIGKILLed while an environment is inside a step publishes, restarted, exactly what
                        an uninterrupted run publishes
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.episodes_check import Recording, check_sample
from tests.integration.test_generate_rollout import loop, publish_versions
from trainingrun.api import parse_trainingrun
from trainingrun.contract.published import read
from trainingrun.contract.engine import Completion
from trainingrun.contract.rollout_state import data_account
from trainingrun.rollout.prompts import ByteTokenizer
from trainingrun.store import open_store

BYTES = ByteTokenizer()
EOS = 2


class ScriptedEngine:
    """Engine protocol over the byte tokenizer: the completion of a context is `script(text of the context)`'s bytes
    and the end token; its log-probabilities are drawn from a hash of the context (distinct per position)."""

    name = "scripted"

    def __init__(self, store, script):
        self.store, self.script, self.version = store, script, -1

    @property
    def weight_version(self) -> int:
        return self.version

    def load_weights(self, version: int) -> None:
        self.store.read_weights(version)
        self.version = version

    def generate(self, prompts, n, sampling):
        out = []
        for p in prompts:
            comps = []
            for i in range(n):
                text = self.script(BYTES.decode(p), i)
                toks = np.asarray(BYTES.encode(text) + [EOS], np.int32)[: sampling.max_new_tokens]
                rng = np.random.default_rng([len(p), *map(int, p[-8:]), i, self.version])
                comps.append(Completion(tokens=toks, logprobs=-rng.random(len(toks)).astype(np.float32),
                                        finish_reason="stop" if toks[-1] == EOS else "length"))
            out.append(comps)
        return out

    def close(self) -> None:
        pass


def spec_doc(prompts_path, environment, **rollout) -> dict:
    r = {"source": {"type": "generate", "generate": {
            "prompts": {"type": "jsonl", "jsonl": {"path": str(prompts_path)}},
            "sampling": {"maxNewTokens": 12}, "environment": environment}},
         "samplesPerRollout": 8, "groupSize": 2, "numRollouts": 2, "maxPendingRollouts": 100,
         "steps": {"policy": "dynamic"}, "filters": {"zeroVariance": False}}
    r.update(rollout)
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "ep"},
            "spec": {"seed": 3, "model": {"preset": "tiny", "vocabSize": 260, "seqLength": 256},
                     "trainer": {"replicas": 2, "maxTokensPerGPU": 1024, "lossType": "ppo"}, "rollout": r}}


def write_prompts(path, texts):
    path.write_text("".join(json.dumps({"prompt": t, "answer": "0"}) + "\n" for t in texts))
    return path


def run(tmp_path, texts, environment, script, **rollout):
    spec = parse_trainingrun(spec_doc(write_prompts(tmp_path / "prompts.jsonl", texts), environment, **rollout)).spec
    store = open_store(f"file://{tmp_path}/store")
    publish_versions(store, range(10))
    engine = Recording(ScriptedEngine(store, script))
    lp = loop(spec, store, engine)
    t0 = time.monotonic()
    result = lp.run()
    return store, engine, result, time.monotonic() - t0


def payloads(store, k):
    return [store.read_payload(k, r) for r in range(2)]


def samples(payload):
    o = payload["offsets"]
    return [(payload["tokens"][a:b], payload["loss_mask"][a:b], payload["logprobs"][a:b])
            for a, b in zip(o[:-1], o[1:])]


def talkative(text: str, i: int) -> str:
    """1 to 3 turns per episode, by prompt and sample; then "stop" (Echo ends the episode on it)."""
    done = text.count("say")
    return "stop" if done >= (len(text.split()[0]) + i) % 3 + 1 else f"say{i}x{done}"


def test_every_turn_of_every_episode_is_exactly_what_the_engine_returned(tmp_path):
    store, engine, result, _ = run(tmp_path, [f"p{k}" * (1 + k % 3) for k in range(8)],
                                   {"type": "class", "className": "tests.envs_fixture:Echo"}, talkative)
    assert result.rollouts == 2
    pairs = engine.pairs()
    turns = []
    for k in range(2):
        p = read(store, k)
        for pl in payloads(store, k):
            assert (pl["versions"] == k).all()  # the weight version the rollout was generated with
            for tokens, mask, logps in samples(pl):
                turns.append(check_sample(tokens, mask, logps, pairs))
        ep = p.stats.episodes
        assert ep.episodes == 8 and ep.failures == {} and ep.turns == sum(turns[-8:])
    assert min(turns) == 2 and max(turns) == 4 and np.mean(turns) > 2  # 1 to 3 turns, then "stop"
    # one engine call per turn with every running episode in it, the first with n = groupSize per prompt
    longest = [max(turns[:8]), max(turns[8:])]
    assert [n for _, n, _ in engine.calls] == [2] + [1] * (longest[0] - 1) + [2] + [1] * (longest[1] - 1)


def test_per_turn_samples_make_groups_of_variable_size_that_no_step_splits(tmp_path):
    store, engine, result, _ = run(tmp_path, [f"q{k}" * (1 + k % 3) for k in range(16)],
                                   {"type": "class", "className": "tests.envs_fixture:Echo", "samples": "turn",
                                    "maxTurns": 8},
                                   talkative, samplesPerRollout=32, numRollouts=1,
                                   steps={"policy": "fixed", "globalBatchSize": 2})
    pairs = {(tuple(ctx), tuple(c.tokens.tolist())): c for ctx, c in engine.pairs()}
    p = read(store, 0)
    per_episode = 2 * 8  # sample id = (group · groupSize + member) · maxTurns + turn
    group_of_step, sizes = {}, {}
    for rank, pl in enumerate(payloads(store, 0)):
        ids = pl["sample_ids"]
        for tokens, mask, logps in samples(pl):
            # a turn's sample: its context unmasked, then exactly the engine's completion for that context
            start = int(np.argmax(mask))
            assert mask[start:].all() and not mask[:start].any()
            c = pairs[(tuple(tokens[:start].tolist()), tuple(tokens[start:].tolist()))]
            assert np.array_equal(logps[start:], c.logprobs) and not logps[:start].any()
        for step in p.steps():
            for mb in p.microbatch_positions(rank, step):
                for i in mb:
                    g = int(ids[i]) // per_episode
                    group_of_step.setdefault(g, set()).add(step.index)
                    sizes.setdefault(step.index, {}).setdefault(g, 0)
                    sizes[step.index][g] += 1
    assert all(len(s) == 1 for s in group_of_step.values()), "a group was split across steps"
    assert all(len(groups) == 2 for groups in sizes.values())  # globalBatchSize: 2 groups per step
    gbs = [sum(sizes[s].values()) for s in sorted(sizes)]
    assert gbs == p.global_batch_sizes and len(set(gbs)) > 1  # the samples counted; the batch size varies
    assert sum(gbs) == p.stats.episodes.turns  # one sample per turn
    ids = [int(i) for pl in payloads(store, 0) for i in pl["sample_ids"]]
    assert len(ids) == len(set(ids))


def test_faulty_environments_fail_their_episodes_only_and_are_counted(tmp_path):
    words = ["ok", "raise", "hang", "nontext", "flood", "exit", "memory", "nan", "reset-raise", "badrole", "ok"]
    env = {"type": "class", "className": "tests.envs_fixture:Faulty", "timeoutSeconds": 1, "workers": 2,
           "memoryMib": 256, "failedReward": -1.0, "maxObservationTokens": 64}

    def script(text, i):  # the first turn repeats the prompt's word to the environment, the next one ends the episode
        return text if "seen" not in text else "done"

    store, engine, result, seconds = run(tmp_path, words, env, script, samplesPerRollout=22, numRollouts=1)
    assert result.rollouts == 1 and seconds < 30  # nothing stalled: two 1 s timeouts, in parallel workers
    ep = read(store, 0).stats.episodes
    assert ep.episodes == 22 and ep.failures == {"error": 4, "timeout": 2, "invalid": 6, "oversized": 2, "exit": 2,
                                                 "memory": 2}
    report = data_account(store).to_json()
    assert report["samples_produced"] == report["samples_published"] == 22  # every episode published
    rewards = sorted(float(r) for pl in payloads(store, 0) for r in pl["rewards"])
    assert rewards == [-1.0] * 18 + [2.0] * 4  # failed: failedReward; ok: 1 + 1 over two turns
    for pl in payloads(store, 0):
        for tokens, mask, logps in samples(pl):
            check_sample(tokens, mask, logps, engine.pairs())


def calc_script(text: str, i: int) -> str:
    """Even members call the calculator with the question's expression and answer with its value; odd ones guess 0."""
    if "</calc>" in text:
        return text.rsplit("</calc>", 1)[1].strip()
    return f"<calc> {text.split('=')[0].strip()} </calc>" if i % 2 == 0 else "0"


CALC_TEXTS = [f"{a} + {b} =" for a, b in [(3, 4), (12, 30), (7, 7), (50, 1), (9, 0), (21, 21), (2, 98), (5, 6),
                                        (13, 8), (40, 2), (1, 1), (66, 3)]]


def calc_spec(tmp_path, marker):
    path = tmp_path / "calc.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "answer": str(eval(t[:-1]))}) + "\n" for t in CALC_TEXTS))
    env = {"type": "class", "className": "tests.envs_fixture:MarkedCalculator", "timeoutSeconds": 120,
           "config": {"marker": str(marker), "index": 5, "pause": 120.0, "calls": 2}, "maxTurns": 3}
    doc = spec_doc(path, env, samplesPerRollout=8, numRollouts=3)
    doc["spec"]["rollout"]["source"]["generate"]["sampling"]["maxNewTokens"] = 24  # "<calc> 12 + 30 </calc>"
    return parse_trainingrun(doc).spec


def _killed_child(tmp_path: str, marker: str) -> None:
    """The rollout of test_a_rollout_killed_mid_episode_restarts_to_the_same_stream, in its own process."""
    store = open_store(f"file://{tmp_path}/store")
    publish_versions(store, range(10))
    loop(calc_spec(Path(tmp_path), marker), store, ScriptedEngine(store, calc_script)).run()


def test_a_rollout_killed_mid_episode_restarts_to_the_same_stream(tmp_path):
    """SIGKILL while an environment of rollout 1 is inside a step (its worker sleeps after writing the marker); the
    restarted rollout publishes exactly what an uninterrupted run publishes: tokens, masks, log-probabilities,
    rewards, sample ids, batch sizes and the episode counts."""
    root = Path(__file__).resolve().parents[2]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    done = tmp_path / "already-paused"
    done.write_text("")
    ref = open_store(f"file://{ref_dir}/store")
    publish_versions(ref, range(10))
    loop(calc_spec(ref_dir, done), ref, ScriptedEngine(ref, calc_script)).run()  # the marker exists: no pause

    marker = tmp_path / "marker"
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); from tests.integration.test_episodes import "
            f"_killed_child; _killed_child({str(run_dir)!r}, {str(marker)!r})")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=root, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), child.stderr.read().decode()[-2000:] if child.poll() is not None else "no marker"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the rollout and its environment workers
        child.wait()
    store = open_store(f"file://{run_dir}/store")
    assert store.is_committed(0) and not store.is_committed(1)  # killed inside rollout 1's episodes

    result = loop(calc_spec(run_dir, marker), store, ScriptedEngine(store, calc_script)).run()
    assert result.rollouts == 3
    for k in range(3):
        a, b = read(store, k), read(ref, k)
        assert a.global_batch_sizes == b.global_batch_sizes and a.stats.episodes == b.stats.episodes
        for x, y in zip(payloads(store, k), payloads(ref, k)):
            assert x.keys() == y.keys() and all(np.array_equal(x[f], y[f]) for f in x), k
    ep = read(ref, 1).stats.episodes
    assert ep.tool_calls == 4 and ep.turns == 12 and ep.reward == 4.0  # 2 of 4 prompts' members called and were right
    report = data_account(store).to_json()
    assert report["samples_produced"] == report["samples_published"] == 24


@pytest.mark.parametrize("truncation", ["mask", "penalize"])
def test_truncated_episodes_are_marked_masked_or_penalised(tmp_path, truncation):
    env = {"type": "class", "className": "tests.envs_fixture:Echo", "maxTurns": 2, "truncation": truncation,
           "truncationReward": -5.0}
    store, engine, _, _ = run(tmp_path, ["a", "b", "c", "d"], env, lambda text, i: "go", numRollouts=1)
    ep = read(store, 0).stats.episodes
    assert ep.episodes == 8 and ep.truncated == 8 and ep.turns == 16  # never done: cut after maxTurns
    for pl in payloads(store, 0):
        rewards = pl["rewards"].tolist()
        for tokens, mask, logps in samples(pl):
            if truncation == "mask":
                assert not mask.any()  # trains nothing
            else:
                assert check_sample(tokens, mask, logps, engine.pairs()) == 2
        assert rewards == [-5.0] * len(rewards) if truncation == "penalize" else rewards == [3.0] * len(rewards)


@pytest.mark.parametrize("reward, expected", [("sum", 1.0 + 2.0 + 3.0), ("final", 3.0)])
def test_episode_reward_is_the_sum_or_the_last_turns(tmp_path, reward, expected):
    env = {"type": "class", "className": "tests.envs_fixture:Echo", "config": {"turns": 3}, "episodeReward": reward}
    store, _, _, _ = run(tmp_path, ["a", "b", "c", "d"], env, lambda text, i: "go", numRollouts=1)
    assert all(r == expected for pl in payloads(store, 0) for r in pl["rewards"].tolist())


def test_the_token_cap_truncates_an_episode_within_it(tmp_path):
    env = {"type": "class", "className": "tests.envs_fixture:Echo", "maxTurns": 50, "maxTokens": 40,
           "truncation": "penalize"}
    store, engine, _, _ = run(tmp_path, ["abc"] * 4, env, lambda text, i: "go on", numRollouts=1)
    ep = read(store, 0).stats.episodes
    assert ep.truncated == 8 and 1 < ep.turns / ep.episodes < 50
    for pl in payloads(store, 0):
        for tokens, mask, logps in samples(pl):
            assert len(tokens) <= 40
            check_sample(tokens, mask, logps, engine.pairs())


class StickyScriptedEngine(ScriptedEngine):
    """The scripted engine as an engine of several replicas (`contract.engine.AffinityEngine`): records the affinity of
    every context it is asked for, and what is released."""

    def __init__(self, store, script):
        super().__init__(store, script)
        self.asked: list[tuple[str, list[int]]] = []
        self.released: list[str] = []

    def generate(self, prompts, n, sampling, *, affinities=None):
        assert affinities is not None and len(affinities) == len(prompts)
        self.asked += [(a, [int(t) for t in p]) for a, p in zip(affinities, prompts)]
        return super().generate(prompts, n, sampling)

    def release(self, affinities):
        self.released += list(affinities)


def test_every_turn_of_an_episode_carries_its_prompts_affinity_and_ends_released(tmp_path):
    """With an engine pool the episodes of one prompt share one affinity key (their first turn is one request; their
    later turns go where the prompt and their own turns are cached): each key's contexts all extend that prompt's
    first context, a later turn's context extends an earlier one of its episode, and every key is released once the
    rollout's episodes ended."""
    from trainingrun.contract.engine import AffinityEngine

    texts = [f"p{k}" * (1 + k % 3) for k in range(8)]
    spec = parse_trainingrun(spec_doc(write_prompts(tmp_path / "prompts.jsonl", texts),
                                      {"type": "class", "className": "tests.envs_fixture:Echo"})).spec
    store = open_store(f"file://{tmp_path}/store")
    publish_versions(store, range(10))
    engine = StickyScriptedEngine(store, talkative)
    assert isinstance(engine, AffinityEngine)
    loop(spec, store, engine).run()
    by_key: dict[str, list[list[int]]] = {}
    for key, ctx in engine.asked:
        by_key.setdefault(key, []).append(ctx)
    assert len(by_key) == 2 * 4  # numRollouts × prompts per rollout: one key per prompt of each call
    for key, contexts in by_key.items():
        first = contexts[0]
        assert all(c[:len(first)] == first for c in contexts), key  # one prompt's episodes
        assert max(len(c) for c in contexts) > len(first)  # and their later turns
    assert sorted(engine.released) == sorted(by_key)  # every key released, none twice
