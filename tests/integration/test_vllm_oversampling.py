"""Over-sampling with abort and partial rollouts against the session's real vLLM server (CPU, the tiny Llama): the
same rollout loop and checks as tests/integration/test_oversampling.py (where a simulated server makes the long tail),
here with vLLM's own abort (`/pause?mode=abort`, the tokens so far) — no prompt lost or repeated, the aborted counts
in the published stats, per-token weight versions of continued completions. Every weight version is the tiny Llama's
own directory (the server holds the same weights throughout; the versions are labels, which is what the per-token
versions record); the server gets its weights back as it had them when the module ends.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_generate_rollout import loop as loop_with_engine
from tests.integration.test_oversampling import doc, trained_positions
from trainingrun.api import parse_trainingrun
from trainingrun.contract import published as contract
from trainingrun.metrics.rollout import RolloutMetrics
from trainingrun.rollout.loop import STATE_KEY, data_report
from trainingrun.rollout.stream import PromptStream
from trainingrun.store import open_store
from trainingrun.vllm.engine import VLLMEngine, make_clients
from trainingrun.vllm.publish import commit_version
from trainingrun.vllm.worker_ext import file_digests

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture
def server(vllm, tiny_llama_dir):
    yield vllm
    from trainingrun.vllm.client import VLLMClient
    from trainingrun.vllm.sync import load_from_disk

    load_from_disk(VLLMClient(vllm.url, timeout=120), str(tiny_llama_dir), "base")


def spec_of(**rollout):
    d = doc(**rollout)
    d["spec"]["model"]["vocabSize"] = 512  # the tiny Llama's vocabulary: the server samples from all of it
    d["spec"]["rollout"]["source"]["generate"]["sampling"]["maxNewTokens"] = 24
    return parse_trainingrun(d).spec


def loop(spec, store, url: str, **kw):
    """The rollout loop over the real server, at most 4 requests in flight: a random model rarely samples its end
    token, so every completion runs to maxNewTokens, and with all requests in flight at once they would all finish
    together and leave nothing to abort; queued, the later ones are still running when enough groups finished."""
    engine = VLLMEngine(make_clients([url], timeout=120), fetch=lambda v: store.read_weights(v)[1], concurrency=4)
    return loop_with_engine(spec, store, engine, **kw)


def publish(store, model: Path, version: int) -> None:
    meta = {"method": "disk", "path": str(model), "files": file_digests(model)}
    assert commit_version(store, version, meta)


def test_vllm_over_sampling_aborts_and_loses_no_prompt(tmp_path: Path, server, tiny_llama_dir):
    spec = spec_of(overSampling=1.0)
    store = open_store(f"file://{tmp_path / 'store'}")
    for v in range(5):
        publish(store, tiny_llama_dir, v)
    metrics = RolloutMetrics("o")
    result = loop(spec, store, server.url, metrics=metrics).run()
    assert result.rollouts == 4
    stats = [contract.read(store, k).stats for k in range(4)]
    aborted = sum(s.groups_aborted for s in stats)
    print(f"vLLM over-sampling: groups produced {[s.groups_produced for s in stats]}, aborted "
          f"{[s.groups_aborted for s in stats]}")
    assert aborted > 0, "the requests still running once enough groups finished are aborted"
    assert metrics.registry.get_sample_value("trainingrun_rollout_groups_total",
                                             {"run": "o", "state": "aborted"}) >= aborted
    trained = trained_positions(store, 4)
    assert len(trained) == len(set(trained)), "no prompt trained twice"
    state = store.get_json(STATE_KEY)
    stream = PromptStream.from_json(state["stream"])
    carried = {int(g["group_id"]) for g in state["carried"]}
    # every position drawn so far is trained, carried or back at the front of the stream: none lost
    assert sorted(set(trained) | carried | set(stream.returned)) == list(range(stream.cursor))
    assert not (set(trained) & set(stream.returned))
    report = data_report(store)
    assert report["samples_produced"] == (report["samples_published"] + sum(report["samples_filtered"].values())
                                          + report["leftover_samples"])


def test_vllm_partial_rollouts_continue_cut_completions_under_newer_versions(tmp_path: Path, server,
                                                                             tiny_llama_dir):
    """A stand-in trainer commits version k+1 after rollout k: vLLM's cut completions are continued in a later
    source rollout under a newer version, every token keeping the version it was generated under."""
    spec = spec_of(partialRollout=True, maxPolicyLag=2, numRollouts=5, overSampling=1.0)
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    publish(store, tiny_llama_dir, 0)

    def trainer():
        reader = open_store(url)
        for k in range(5):
            if not reader.wait_rollout(k, timeout=300):
                return
            for r in range(2):
                reader.ack(k, r)
            publish(reader, tiny_llama_dir, k + 1)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    result = loop(spec, store, server.url).run()
    t.join(60)
    assert result.rollouts == 5
    mixed = 0
    for k in range(5):
        for r in range(2):
            pl = store.read_payload(k, r)
            tv, mask = pl["token_versions"], pl["loss_mask"]
            assert (tv[mask == 0] == -1).all() and (tv[mask > 0] >= 0).all()
            assert (tv[mask > 0] <= k).all() and (tv[mask > 0] >= k - 2).all()
            off = pl["offsets"]
            for a, b in zip(off[:-1], off[1:]):
                vs = tv[a:b][mask[a:b] > 0]
                if len(vs) and vs.min() != vs.max():
                    mixed += 1
                    assert (np.diff(vs) >= 0).all(), "a continued completion's versions only grow"
    carried = sum(contract.read(store, k).stats.partials_carried for k in range(5))
    print(f"vLLM partial rollouts: {carried} cut completions carried, {mixed} completions of two versions")
    assert carried > 0 and mixed > 0
    trained = trained_positions(store, 5)
    assert len(trained) == len(set(trained))
