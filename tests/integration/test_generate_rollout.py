"""The rollout loop with generated rollouts, against a real store (temp directory or redis-server), with a stand-in
engine: the real engine needs Megatron and its CPU shim, which are process-global and never enter the pytest process
(the real engine is tested in test_megatron_engine.py and end to end in test_rl_e2e.py). The stand-in implements the
Engine protocol: it loads weight versions from the store exactly as the real one and samples deterministically from
(seed, prompt, weights).

Checks: pinned staleness (rollout k waits for weight version k - maxPolicyLag and records it), the staged state makes a
rollout that died after committing but before saving its state publish exactly the same data again (no prompt lost or
repeated), carried groups older than the bound are dropped as "stale", failing rewards never stop the rollout.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.contract.published import read
from trainingrun.contract.engine import Completion
from trainingrun.rollout.generate import GenerateSource
from trainingrun.contract.rollout_state import ROLLOUT_STATE_KEY, data_account
from trainingrun.rollout.loop import RolloutLoop
from trainingrun.store import open_store


class StandInEngine:
    """Engine protocol in plain numpy: completion tokens from a hash of (seed, prompt, weights, sample)."""

    name = "stand-in"

    def __init__(self, store, vocab: int = 8):
        self.store, self.vocab, self.version, self.loads = store, vocab, -1, []

    @property
    def weight_version(self) -> int:
        return self.version

    def load_weights(self, version: int) -> None:
        arrays, meta = self.store.read_weights(version)
        self.bias = float(arrays["w"][0])
        self.version = version
        self.loads.append(version)

    def generate(self, prompts, n, sampling):
        out = []
        for p in prompts:
            comps = []
            for i in range(n):
                rng = np.random.default_rng([sampling.seed, *map(int, p), i, int(self.bias * 1000)])
                m = int(rng.integers(1, sampling.max_new_tokens + 1))
                toks = rng.integers(3, self.vocab, size=m).astype(np.int32)
                if rng.random() < 0.5:
                    toks[-1] = 2
                comps.append(Completion(tokens=toks, logprobs=-rng.random(m).astype(np.float32),
                                        finish_reason="stop" if toks[-1] == 2 else "length"))
            out.append(comps)
        return out

    def close(self) -> None:
        pass


def doc(**rollout) -> dict:
    r = {"source": {"type": "generate", "generate": {
            "prompts": {"synthetic": {"task": "copy", "minLength": 1, "maxLength": 3, "vocabSize": 8}},
            "sampling": {"maxNewTokens": 4}, "reward": {"type": "token_match"}}},
         "samplesPerRollout": 32, "groupSize": 4, "numRollouts": 6, "maxPendingRollouts": 100,
         "steps": {"policy": "dynamic"}}
    r.update(rollout)
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "g"},
            "spec": {"seed": 3, "model": {"preset": "tiny", "vocabSize": 8, "seqLength": 32},
                     "trainer": {"replicas": 2, "maxTokensPerGPU": 64, "lossType": "ppo"}, "rollout": r}}


def publish_versions(store, versions) -> None:
    for v in versions:
        store.publish_weights(v, {"w": np.array([v * 0.5], np.float32)}, {"dtypes": {}})


def loop(spec, store, engine=None, **kw) -> RolloutLoop:
    """A RolloutLoop whose generated source uses the stand-in engine (the real one is built by make_engine)."""
    engine = engine or StandInEngine(store)
    lp = RolloutLoop.__new__(RolloutLoop)
    import trainingrun.rollout.loop as loop_mod

    orig = loop_mod.make_source
    loop_mod.make_source = lambda s, arch, say, st, max_wait: GenerateSource(s, st, arch=arch, say=say, engine=engine,
                                                                             max_wait=max_wait)
    try:
        RolloutLoop.__init__(lp, spec, store, progress=kw.pop("progress", lambda _m: None), **kw)
    finally:
        loop_mod.make_source = orig
    return lp


@pytest.fixture(params=["file", "redis"])
def url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue("redis").url + "?prefix=gen"


def published(store, n):
    return [(read(store, k), [store.read_payload(k, r) for r in range(2)]) for k in range(n)]


@pytest.mark.parametrize("lag", [0, 1])
def test_each_rollout_is_generated_with_exactly_version_k_minus_lag(url, lag):
    """A stand-in trainer publishes version k+1 only after 'training' rollout k; the rollout waits for the version it
    needs, no longer."""
    spec = parse_trainingrun(doc(maxPolicyLag=lag)).spec
    store = open_store(url)
    engine = StandInEngine(store)
    publish_versions(store, [0])
    trained = []

    def trainer():
        reader = open_store(url)
        for k in range(6):
            assert reader.wait_rollout(k, timeout=30)
            time.sleep(0.05)
            trained.append((k, reader.latest_weights()))
            for r in range(2):
                reader.ack(k, r)
            publish_versions(reader, [k + 1])

    t = threading.Thread(target=trainer)
    t.start()
    result = loop(spec, store, engine).run()
    t.join(30)
    assert result.rollouts == 6
    for k, (p, payloads) in enumerate(published(store, 6)):
        v = max(0, k - lag)
        assert p.stats.weight_version == v and all(s.weight_version == v for s in p.steps())
        assert all((pl["versions"] == v).all() for pl in payloads)
        assert all(len(pl["logprobs"]) == len(pl["tokens"]) for pl in payloads)
        # loss only on the completions: the logprobs of prompt tokens are 0
        assert all((pl["logprobs"][pl["loss_mask"] == 0] == 0).all() for pl in payloads)
    assert engine.loads == list(range(6 - lag))


def test_restart_after_commit_publishes_the_staged_groups_again(url):
    """A rollout that dies after committing rollout 2 but before saving its state: restarted, it reuses the staged
    groups (a regenerated source rollout could differ — other weights, other samples — and its carry would then
    repeat or lose prompts) and everything published equals an uninterrupted run's."""
    spec = parse_trainingrun(doc(numRollouts=5, steps={"policy": "fixed", "globalBatchSize": 3})).spec
    ref_store = open_store(url.replace("prefix=gen", "prefix=ref") if url.startswith("redis") else url + "-ref")
    publish_versions(ref_store, range(6))
    loop(spec, ref_store).run()

    store = open_store(url)
    publish_versions(store, range(6))

    class Killed(Exception):
        pass

    class DiesAfterCommit:
        def __init__(self, inner):
            self.inner, self.url = inner, inner.url

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def put_json(self, key, value):
            if key == ROLLOUT_STATE_KEY and value["next_rollout"] == 3 and value["staged"] is None:
                raise Killed()
            self.inner.put_json(key, value)

    with pytest.raises(Killed):
        loop(spec, DiesAfterCommit(store)).run()
    assert store.is_committed(2) and store.get_json(ROLLOUT_STATE_KEY)["staged"] is not None
    # the restarted rollout would sample other completions now: other weights under the same version numbers
    store.release_weights_below(100)
    publish_versions(store, range(100, 101))
    for v in range(6):
        store.publish_weights(v, {"w": np.array([v * 0.5 + 7.0], np.float32)}, {})
    result = loop(spec, store).run()
    n = min(result.rollouts, ref_store.get_json(ROLLOUT_STATE_KEY)["next_rollout"])
    a, b = published(store, n), published(ref_store, n)
    for (pa, la), (pb, lb) in zip(a[:3], b[:3]):  # committed before the crash: what the reference has
        assert pa.global_batch_sizes == pb.global_batch_sizes
        for x, y in zip(la, lb):
            assert all(np.array_equal(x[f], y[f]) for f in x)
    # rollout 3 starts from the groups carried out of rollout 2: the staged ones, as in the reference. They were
    # generated one weight version before rollout 3's, so both drop them as stale and carry none in (before, the
    # published count said they were carried in)
    (p3, l3), (r3, m3) = a[3], b[3]
    assert p3.stats.filtered["stale"] == r3.stats.filtered["stale"] > 0
    assert p3.stats.carried_in == r3.stats.carried_in == 0
    per_source = 4 * 8  # sample ids: (source index * prompts per rollout + prompt) * groupSize + i
    carried = lambda pls, src: sorted(i for pl in pls for i in pl["sample_ids"].tolist() if i // per_source < src)  # noqa: E731
    assert carried(l3, p3.stats.source_index) == carried(m3, r3.stats.source_index)
    ids = [i for _, pls in a for pl in pls for i in pl["sample_ids"].tolist()]
    assert len(ids) == len(set(ids))  # no prompt trained twice
    report = data_account(store).to_json()
    assert report["samples_produced"] == (report["samples_published"] + sum(report["samples_filtered"].values())
                                          + report["leftover_samples"])


def test_carried_groups_older_than_the_bound_are_dropped_as_stale(url):
    """Groups carried from an earlier source rollout were generated with older weights: at maxPolicyLag 0 they may
    not be trained with a later rollout."""
    spec = parse_trainingrun(doc(numRollouts=3, steps={"policy": "fixed", "globalBatchSize": 5})).spec
    store = open_store(url)
    publish_versions(store, range(10))
    result = loop(spec, store).run()
    report = data_account(store).to_json()
    assert report["samples_filtered"].get("stale", 0) > 0
    for k in range(result.rollouts):
        p = read(store, k)
        assert p.stats.carried_in == 0 or p.stats.filtered.get("stale", 0) > 0 or k == 0
        for pl in (store.read_payload(k, r) for r in range(2)):
            assert (pl["versions"] == k).all()  # nothing older than the rollout's own version is trained
    assert report["samples_produced"] == (report["samples_published"] + sum(report["samples_filtered"].values())
                                          + report["leftover_samples"])


def test_carried_in_counts_only_the_carried_groups_that_are_trained(url):
    """At maxPolicyLag 0 a group carried past a published rollout was generated one weight version before the next
    rollout's, so it is always dropped as stale. The published count and the log say so: nothing carried in, the
    drop named. Before, both said the dropped groups were carried in."""
    spec = parse_trainingrun(doc(numRollouts=4, steps={"policy": "fixed", "globalBatchSize": 3})).spec
    store = open_store(url)
    publish_versions(store, range(10))
    said = []
    result = loop(spec, store, progress=said.append).run()
    stale = 0
    for k in range(result.rollouts):
        p = read(store, k)
        assert p.stats.carried_in == 0, (k, p.stats)
        stale += p.stats.filtered.get("stale", 0)
    assert stale > 0
    published_lines = [m for m in said if m.startswith("rollout ") and "samples in" in m]
    assert all(" 0 carried in" in m for m in published_lines), published_lines
    assert any("carried dropped as stale" in m for m in published_lines)


def test_failing_rewards_are_counted_and_the_rollout_goes_on(url, tmp_path):
    d = doc(numRollouts=2)
    d["spec"]["rollout"]["source"]["generate"]["reward"] = {"type": "function", "function":
                                                            "tests.rewards_fixture:flaky", "timeoutSeconds": 1}
    spec = parse_trainingrun(d).spec
    store = open_store(url)
    publish_versions(store, range(3))

    class Hostile(StandInEngine):
        """Completions whose rewards raise, hang, return NaN: their texts reach the reward as token lists."""

    engine = Hostile(store)
    lp = loop(spec, store, engine)
    responses = iter(["raise", "hang", "nan"] * 100)
    orig = lp.source._response
    lp.source._response = lambda ctoks, prompt: next(responses) if np.random.default_rng(int(ctoks.sum())).random() < 0.2 \
        else orig(ctoks, prompt)
    result = lp.run()
    assert result.rollouts == 2
    failed = sum(read(store, k).stats.reward_failed for k in range(2))
    assert failed > 0
