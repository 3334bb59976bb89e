"""Multi-turn episodes on a real vLLM server (rollout/episodes.py through vllm/engine.py; the shared session server
of tests/conftest.py on the tiny Llama, its word-level tokenizer), with a real environment in its worker process:

  * token in, token out: every turn of every episode's sample is exactly the tokens and log-probabilities the
    server returned for exactly the context before it (loss mask 1), every environment token has mask 0
    (`tests/episodes_check.py`), one completions call per turn with every running episode;
  * the trained log-probabilities are the engine's own: the server scoring the finished episodes gives them back
    (SAME_ENGINE_TOL: decode vs prefill in bf16, test_vllm.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.episodes_check import Recording, check_sample
from tests.integration.test_vllm import EOS, SAME_ENGINE_TOL
from trainingrun.api.spec.rollout import EnvironmentSpec
from trainingrun.contract.engine import Sampling
from trainingrun.modeling.tokenizer import run_tokenizer
from trainingrun.rollout.episodes import EpisodeRunner, build_group
from trainingrun.rollout.prompts import Prompt
from trainingrun.engines.vllm.client import VLLMClient
from trainingrun.engines.vllm.engine import VLLMEngine

pytestmark = pytest.mark.vllm

ENV = {"type": "class", "className": "tests.envs_fixture:Echo", "config": {"turns": 3}, "maxTurns": 4,
       "maxTokens": 100}


def test_vllm_episodes_token_in_token_out(vllm, tiny_llama_dir: Path):
    client = VLLMClient(vllm.url, timeout=120)
    engine = Recording(VLLMEngine(client, fetch={0: {"method": "disk", "path": str(tiny_llama_dir)}}.__getitem__,
                                  label_prefix="episodes-v", concurrency=8, restart_timeout=600,
                                  say=lambda msg: print(msg, flush=True)))
    engine.load_weights(0)
    tok = run_tokenizer(tiny_llama_dir)
    env = EnvironmentSpec.model_validate(ENV)
    texts = ["t5 t17 t42", "t99", "t300 t301 t302 t303 t304 t305", "t7 t8"]
    prompts = [Prompt(tokens=np.asarray(tok.encode(t), np.int32), reference="0", index=k, text=t)
               for k, t in enumerate(texts)]
    runner = EpisodeRunner(env, tokenizer=tok, chat=False, stop_ids=(EOS,), stops=(), max_new_tokens=6,
                           seq_length=128, prompt_type="jsonl")
    try:
        by_prompt = runner.run(engine, prompts, 3, Sampling(temperature=1.0, max_new_tokens=6,
                                                             stop_token_ids=(EOS,), seed=11), seed=5)
    finally:
        runner.close()
    groups = [build_group(j, eps, env, version=0, group_size=3) for j, eps in enumerate(by_prompt)]
    pairs = engine.pairs()
    turns, diffs = [], []
    for g in groups:
        assert len(g) == 3 and (g.versions == 0).all()
        for t, m, lp in zip(g.tokens, g.loss_masks, g.logprobs):
            turns.append(check_sample(t, m, lp, pairs))
            scored = np.asarray(client.prompt_logprobs(t.tolist()), np.float32)  # log p(t_i | t_<i), i >= 1
            on = np.flatnonzero(m[1:]) + 1
            diffs.append(float(np.abs(scored[on - 1] - lp[on]).max()))
    assert len(turns) == 12 and sum(turns) > len(turns)  # multi-turn (Echo: 3 turns unless the cap comes first)
    calls = [n for _, n, _ in engine.calls]
    assert calls[0] == 3 and calls[1:] and set(calls[1:]) == {1}
    assert max(diffs) < SAME_ENGINE_TOL, diffs
