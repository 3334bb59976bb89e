"""Over-sampling with abort and partial rollouts against the session's real vLLM server (CPU, the tiny Llama): the
same rollout loop and checks as tests/integration/test_oversampling.py (where a simulated server makes the long tail),
here with vLLM's own abort (`/pause?mode=abort`, the tokens so far) — no prompt lost or repeated, the aborted counts
in the published stats, per-token weight versions of continued completions. Every weight version is the tiny Llama's
own directory (the server holds the same weights throughout; the versions are labels, which is what the per-token
versions record); the server gets its weights back as it had them when the module ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_generate_rollout import loop as loop_with_engine
from tests.integration.test_oversampling import (
    assert_no_prompt_lost_or_repeated,
    check_token_versions,
    doc,
    run_with_stand_in_trainer,
)
from trainingrun.api import parse_trainingrun
from trainingrun.contract.published import read
from trainingrun.metrics.rollout import RolloutMetrics
from trainingrun.store import open_store
from trainingrun.engines.vllm.engine import VLLMEngine, make_clients
from trainingrun.engines.vllm.publish import commit_version
from trainingrun.engines.vllm.worker_ext import file_digests

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture
def server(vllm, tiny_llama_dir):
    yield vllm
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.sync import load_from_disk

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
    # An abort needs a request still decoding once enough groups finished; under load the queued requests can all
    # finish before the loop sees enough groups (the full suite of 2026-12-04: 16 groups produced in each rollout,
    # 0 aborted). Every run is checked in full; up to 3 runs for an abort to happen at all.
    for attempt in range(3):
        store = open_store(f"file://{tmp_path / f'store{attempt}'}")
        for v in range(5):
            publish(store, tiny_llama_dir, v)
        metrics = RolloutMetrics("o")
        result = loop(spec, store, server.url, metrics=metrics).run()
        assert result.rollouts == 4
        stats = [read(store, k).stats for k in range(4)]
        aborted = sum(s.groups_aborted for s in stats)
        print(f"vLLM over-sampling, run {attempt + 1}: groups produced {[s.groups_produced for s in stats]}, "
              f"aborted {[s.groups_aborted for s in stats]}")
        counted = metrics.registry.get_sample_value("trainingrun_rollout_groups_total",
                                                    {"run": "o", "state": "aborted"})
        assert (counted or 0) >= aborted, (counted, aborted)
        assert_no_prompt_lost_or_repeated(store, 4)
        if aborted > 0:
            break
    assert aborted > 0, "the requests still running once enough groups finished are aborted"


def test_vllm_partial_rollouts_continue_cut_completions_under_newer_versions(tmp_path: Path, server,
                                                                             tiny_llama_dir):
    """A stand-in trainer commits version k+1 after rollout k: vLLM's cut completions are continued in a later
    source rollout under a newer version, every token keeping the version it was generated under."""
    # maxPendingRollouts 1: source rollout k+1 starts once the trainer took rollout k, after it committed version
    # k+1, so every continuation runs under a newer version than its cut (with rollouts pending, a loaded machine
    # let the loop run ahead under the same version and no completion held two)
    spec = spec_of(partialRollout=True, maxPolicyLag=2, numRollouts=5, overSampling=1.0, maxPendingRollouts=1)
    # A cut needs a request still decoding when enough groups finished; the random model's completions all run to
    # maxNewTokens, so on a loaded machine the requests can finish in lockstep and nothing is cut (the last CI-like
    # run here: 0 carried). Every run is checked in full; up to 3 runs for the cut to happen at all.
    for attempt in range(3):
        store, result = run_with_stand_in_trainer(f"file://{tmp_path / f'store{attempt}'}",
                                                  lambda st, v: publish(st, tiny_llama_dir, v),
                                                  lambda st: loop(spec, st, server.url).run(), 5, timeout=300)
        assert result.rollouts == 5
        mixed = check_token_versions(store, 5, 2)
        carried = sum(read(store, k).stats.partials_carried for k in range(5))
        assert_no_prompt_lost_or_repeated(store, 5)
        print(f"vLLM partial rollouts, run {attempt + 1}: {carried} cut completions carried, {mixed} completions "
              "of two versions")
        if carried > 0 and mixed > 0:
            break
    assert carried > 0 and mixed > 0
