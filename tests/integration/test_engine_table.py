"""A new engine type from the tests alone (docs/architecture.md, "A new engine type"), and the engine table's rules.

The stand-in engine type `standin` is what a new engine type served by servers brings, and nothing else:
  * its replica adapter (`StandInReplica`: the pool's `ReplicaAdapter` — generate, abort, label, wait_healthy, load)
    over in-memory "servers" whose completions are a function of (prompt, sample, the loaded weights), under the real
    engine pool (`trainingrun.engines.pool.EnginePool`), built by its builder from the spec;
  * its weight-sync publisher (`StandInPublisher`, for weightSync.type store): commits a version's meta in the store;
  * its entry, added with `trainingrun.engines.table.register`.
The one step of the recipe a test cannot take from outside is the API's Literal for `rollout.engine.type`: the spec
is validated with type megatron and weightSync store (the pair the spec admits) and its engine type is then swapped
to `standin` (`model_copy`), the spec admission would give once the Literal named it. Then an unmodified rollout
loop (`RolloutLoop`, which gets its engine from the table) runs rollouts with it against a real store, while a
stand-in trainer publishes each version through `trainingrun.trainer.weights.make_publisher` (the table's publisher
of the standin entry).
"""

from __future__ import annotations

import threading
import typing

import numpy as np
import pytest

from trainingrun.api import parse_trainingrun
from trainingrun.api.spec.engine import EngineSpec
from trainingrun.contract import published as contract
from trainingrun.contract.engine import EngineUnavailable, Sampling
from trainingrun.contract.errors import ConfigError
from trainingrun.engines import table
from trainingrun.engines.pool import LOADING, EnginePool
from trainingrun.rollout.loop import RolloutLoop
from trainingrun.store import open_store

EOS = 2
VOCAB = 8
LAG = 0
ROLLOUTS = 4


def standin_tokens(prompt, sample: int, bias: int, max_tokens: int) -> list[int]:
    """The stand-in's completion of `prompt` (sample `sample`) under weights with `bias`: 1..max_tokens tokens in
    3..7, ending with EOS when shorter than max_tokens."""
    s = int(sum(prompt)) + bias + 3 * sample
    m = 1 + s % max_tokens
    toks = [3 + (s + j) % (VOCAB - 3) for j in range(m)]
    if m < max_tokens:
        toks[-1] = EOS
    return toks


def standin_logprob(token: int, bias: int) -> float:
    return -((token + bias) % 5 + 1) / 10


class Answer(typing.NamedTuple):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class StandInReplica:
    """The pool's adapter for one in-memory stand-in server."""

    def __init__(self, name: str):
        self.url = f"standin://{name}"
        self.label_now = "initial"
        self.bias: int | None = None
        self.loaded: list[int] = []  # versions loaded, in order
        self.requests = 0

    def generate(self, prompt, *, n, max_tokens, sampling: Sampling, seed):
        if self.bias is None:
            raise EngineUnavailable(f"{self.url}: no weights")
        self.requests += 1
        out = []
        for i in range(n):
            toks = standin_tokens(prompt, i, self.bias, max_tokens)
            out.append(Answer(toks, [standin_logprob(t, self.bias) for t in toks],
                              "stop" if len(toks) < max_tokens else "length"))
        return out

    def abort(self) -> None:
        pass  # answers are immediate: nothing is ever in flight to cut

    def label(self, timeout=None) -> str:
        return self.label_now

    def wait_healthy(self, timeout: float) -> float:
        return 0.0

    def load(self, version, meta, *, label, timeout):
        assert meta["method"] == "standin" and meta["version"] == version, meta
        self.label_now = LOADING + label(version)
        self.bias = int(meta["bias"])
        self.loaded.append(version)
        self.label_now = label(version)
        return {"version": version}


class StandInPublisher:
    """The trainers' side: rank 0 commits version v's weights (`module`: {"bias": int}) as the version's meta."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank

    def publish(self, version: int, module) -> None:
        if self.rank == 0:
            self.store.publish_weights(version, {"version": np.asarray([version], np.int64)},
                                       {"method": "standin", "bias": int(module["bias"]), "version": version})

    def close(self) -> None:
        pass


def bias_of(version: int) -> int:
    return 10 * version + 1


@pytest.fixture
def standin():
    """The `standin` entry, registered for the test; what its builder built."""
    built: list[EnginePool] = []

    def build(spec, store, arch):
        pool = EnginePool([StandInReplica("a"), StandInReplica("b")], name="standin",
                          fetch=lambda v: store.read_weights(v)[1], concurrency=2, say=lambda m: None)
        built.append(pool)
        return pool

    entry = table.register(table.EngineType(
        name="standin", build=build,
        publishers={"store": lambda spec, store, *, arch, rank, attempt=0: StandInPublisher(store, rank)}))
    try:
        yield built
    finally:
        del table.ENGINES["standin"]


def standin_spec():
    """A spec the API validates (engine megatron, weightSync store), its engine type then swapped to standin."""
    spec = parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "s"},
        "spec": {"seed": 5, "model": {"preset": "tiny", "vocabSize": VOCAB, "seqLength": 32},
                 "trainer": {"replicas": 2, "maxTokensPerGPU": 64, "lossType": "ppo"},
                 "rollout": {"source": {"type": "generate", "generate": {
                     "prompts": {"synthetic": {"task": "copy", "minLength": 1, "maxLength": 3,
                                               "vocabSize": VOCAB}},
                     "sampling": {"maxNewTokens": 4}, "reward": {"type": "token_match"}}},
                     "engine": {"type": "megatron"},
                     "samplesPerRollout": 32, "groupSize": 4, "numRollouts": ROLLOUTS, "maxPendingRollouts": 100,
                     "maxPolicyLag": LAG, "steps": {"policy": "dynamic"}},
                 "weightSync": {"type": "store"}}}).spec
    engine = spec.rollout.engine.model_copy(update={"type": "standin"})
    return spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"engine": engine})})


def test_a_stand_in_engine_type_registered_from_a_test_runs_a_rollout(tmp_path, standin):
    from trainingrun.trainer.weights import make_publisher

    spec = standin_spec()
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    arch = spec.model.resolved()
    publisher = make_publisher(spec, store, arch=arch, rank=0)  # the table's publisher of the standin entry
    assert isinstance(publisher, StandInPublisher)
    publisher.publish(0, {"bias": bias_of(0)})
    assert table.own_servers(spec) == 0  # in-memory servers: nothing for the launcher or the operator to run

    def trainer() -> None:  # consumes rollout k, then publishes version k + 1 through its own store
        reader = open_store(url)
        pub = make_publisher(spec, reader, arch=arch, rank=0)
        for k in range(ROLLOUTS):
            assert reader.wait_rollout(k, timeout=60)
            for r in range(2):
                reader.ack(k, r)
            pub.publish(k + 1, {"bias": bias_of(k + 1)})
        reader.close()

    t = threading.Thread(target=trainer)
    t.start()
    result = RolloutLoop(spec, store, progress=lambda _m: None).run()
    t.join(60)
    assert result.rollouts == ROLLOUTS
    [pool] = standin  # the rollout's engine came from the table
    assert pool.name == "standin" and pool.weight_version == ROLLOUTS - 1 - LAG
    replicas = [r.adapter for r in pool.replicas]
    assert all(a.loaded == list(range(ROLLOUTS - LAG)) for a in replicas)  # every version, into every replica
    assert all(a.requests > 0 for a in replicas) and sum(pool.served().values()) > 0  # the pool's dispatch
    max_tokens = spec.rollout.source.generate.sampling.max_new_tokens
    samples = 0
    for k in range(ROLLOUTS):
        p = contract.read(store, k)
        assert p.stats.weight_version == k - LAG
        for r in range(2):
            pl = store.read_payload(k, r)
            assert (pl["versions"] == k - LAG).all()
            for i in range(len(pl["offsets"]) - 1):
                a, b = pl["offsets"][i], pl["offsets"][i + 1]
                tokens, mask, lps = pl["tokens"][a:b], pl["loss_mask"][a:b], pl["logprobs"][a:b]
                prompt = tokens[: int(np.argmax(mask))]  # the loss mask (and the logprobs) cover the completion
                completion = tokens[len(prompt):].tolist()
                bias = bias_of(k - LAG)
                assert any(completion == standin_tokens(prompt, j, bias, max_tokens) for j in range(4)), \
                    (prompt, completion)  # produced by the stand-in, with the weights of version k - lag
                assert np.allclose(lps[mask == 1], [standin_logprob(t, bias) for t in completion])
                samples += 1
    assert samples >= ROLLOUTS * 8
    store.close()


def test_every_engine_type_the_api_admits_has_an_entry():
    admitted = set(typing.get_args(EngineSpec.model_fields["type"].annotation))
    assert admitted == set(table.ENGINES) and {"megatron", "vllm"} <= admitted
    for name, entry in table.ENGINES.items():
        assert entry.name == name and entry.publishers, name


def test_the_table_refuses_a_duplicate_an_unknown_type_and_a_sync_an_engine_cannot_load(standin):
    with pytest.raises(ValueError, match="'vllm' is in the table already"):
        table.register(table.EngineType(name="vllm", build=lambda *a: None, publishers={}))
    spec = standin_spec()
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.type: 'nope' is not available in this build; allowed: "
                                          r"megatron, standin, vllm$"):
        table.engine_type("nope")
    disk = spec.model_copy(update={"weight_sync": spec.weight_sync.model_copy(update={"type": "disk"})})
    with pytest.raises(ConfigError, match=r"^weightSync\.type: 'disk' does not reach the standin engine; "
                                          r"allowed: store$"):
        table.make_publisher(disk, None, arch=None, rank=0)


@pytest.mark.parametrize("engine,replicas", [
    ({"type": "megatron"}, 0),  # in the rollout process
    ({"type": "vllm", "url": "http://a:8000,http://b:8000"}, 0),  # the user's servers
    ({"type": "vllm", "replicas": 3}, 3),  # the run's own
])
def test_the_run_owns_its_engines_by_one_rule(engine, replicas):
    """`own_servers` is the rule of the operator (engine pods) and the local launcher (engine processes), and the
    plan's engine roles follow it."""
    from trainingrun.operator import vocabulary
    from trainingrun.operator.render import plan_for

    run = parse_trainingrun({
        "apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "r"},
        "spec": {"model": {"hf": "/models/m", "seqLength": 64}, "trainer": {"replicas": 1, "maxTokensPerGPU": 64},
                 "rollout": {"source": {"type": "generate", "generate": {}}, "engine": engine},
                 "weightSync": {"type": "store" if engine["type"] == "megatron" else "disk"}}})
    assert table.own_servers(run.spec) == vocabulary.engine_replicas(run) == replicas
    assert vocabulary.engine_is_managed(run) == (replicas > 0)
    plan = plan_for(run, "ns", attempt=2)
    assert [(e.name, e.role, e.type) for e in plan.engines] == [
        (f"engine-{i}", "engine", engine["type"]) for i in range(replicas)]
