"""Multi-turn episodes on the in-process Megatron engine (rollout/episodes.py, engines/megatron.py), in a
subprocess (the CPU shim is process-global), with a real environment in its worker process:

  * token in, token out: every turn of every episode's sample is exactly the engine's tokens and log-probabilities
    (loss mask 1), every environment token has mask 0 (`tests/episodes_check.py`);
  * the KV cache continued across turns (the engine reuses the positions of the earlier turns): the same tokens as
    without it, its log-probabilities those of one full forward of the finished episode (≤ 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron
ROOT = Path(__file__).resolve().parents[2]

SIZES = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=260,
             seq_length=160, precision="fp32")
ENV = {"type": "class", "className": "tests.envs_fixture:Echo", "config": {"turns": 3}, "maxTurns": 4,
       "maxTokens": 150}


def _worker(store_url: str, out_path: str) -> None:
    import numpy as np
    import torch

    from tests.episodes_check import Recording, check_sample
    from trainingrun.api.spec.rollout import EnvironmentSpec
    from trainingrun.contract.engine import Sampling
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.state import state_dict_arrays
    from trainingrun.rollout.episodes import EpisodeRunner, build_group
    from trainingrun.engines.megatron import MegatronEngine
    from trainingrun.rollout.prompts import ByteTokenizer, Prompt
    from trainingrun.store import open_store

    store = open_store(store_url)
    env = EnvironmentSpec.model_validate(ENV)
    engines = {}
    for reuse in (True, False):
        engines[reuse] = MegatronEngine(resolve(**SIZES), fetch=store.read_weights, seed=3, max_batch=64,
                                        reuse_cache=reuse)
        if reuse:
            arrays, dtypes = state_dict_arrays(engines[reuse].model)
            store.publish_weights(0, arrays, {"dtypes": dtypes})
        engines[reuse].load_weights(0)
    tok = ByteTokenizer()
    prompts = [Prompt(tokens=np.asarray(tok.encode(t), np.int32), reference="0", index=k, text=t)
               for k, t in enumerate(["two plus two", "hi", "a longer first observation", "x"])]
    sampling = Sampling(temperature=1.0, max_new_tokens=6, stop_token_ids=(2,), seed=11)
    result = {}
    for reuse, engine in engines.items():
        runner = EpisodeRunner(env, tokenizer=tok, chat=False, stop_ids=(2,), stops=(), max_new_tokens=6,
                               seq_length=SIZES["seq_length"], prompt_type="jsonl")
        rec = Recording(engine)
        by_prompt = runner.run(rec, prompts, 3, sampling, seed=5)
        runner.close()
        groups = [build_group(j, eps, env, version=0, group_size=3) for j, eps in enumerate(by_prompt)]
        turns, diffs = [], []
        with torch.no_grad():
            for g in groups:
                for t, m, lp in zip(g.tokens, g.loss_masks, g.logprobs):
                    turns.append(check_sample(t, m, lp, rec.pairs()))
                    seq = torch.tensor(t[None].astype(np.int64))
                    logits = engine.model(seq, torch.arange(seq.shape[1])[None], None, runtime_gather_output=True)
                    full = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, seq[0, 1:, None]).squeeze(-1)
                    on = np.flatnonzero(m[1:]) + 1
                    diffs.append(float(np.abs(full.numpy()[on - 1] - lp[on]).max()))
        result[str(reuse)] = {
            "turns": turns, "max_diff": max(diffs), "reused": engine.stats["reused_tokens"],
            "tokens": [t.tolist() for g in groups for t in g.tokens],
            "logprobs": [lp.tolist() for g in groups for lp in g.logprobs],
            "calls": [n for _, n, _ in rec.calls], "ends": [e.end for eps in by_prompt for e in eps]}
    Path(out_path).write_text(json.dumps(result))


def test_megatron_episodes_token_in_token_out_with_the_kv_cache_continued(tmp_path):
    out = tmp_path / "out.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.integration.test_episodes_megatron import "
            f"_worker; _worker({f'file://{tmp_path}/store'!r}, {str(out)!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    cached, fresh = r["True"], r["False"]
    assert cached["turns"] and min(cached["turns"]) >= 1 and sum(cached["turns"]) > len(cached["turns"])  # multi-turn
    assert cached["calls"][0] == 3 and cached["calls"][1:] and set(cached["calls"][1:]) == {1}
    assert cached["max_diff"] < 1e-5 and fresh["max_diff"] < 1e-5  # = one full forward of the finished episode
    assert cached["reused"] > 0 and fresh["reused"] == 0
    assert cached["tokens"] == fresh["tokens"] and cached["ends"] == fresh["ends"]  # the same draws with the cache
    assert max(abs(a - b) for x, y in zip(cached["logprobs"], fresh["logprobs"]) for a, b in zip(x, y)) < 1e-5
