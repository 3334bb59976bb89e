"""Hugging Face models in and out, on real Megatron code and real `transformers` (random weights, CPU).

* HF → Megatron → HF is bit-exact: the HF weights loaded into Megatron models by `build_model` (TP 1, and TP 2 with
  each rank holding its shard), read back from the models, gathered and converted, equal the safetensors bit for bit.
* `trainingrun score` on the HF directory gives transformers' per-token log-probabilities (≤ 1e-4, fp32).
* A run initialised with `model.hf` (TP 1, and TP 2 over two processes) trains; TP 2 gives TP 1's per-step losses;
  `trainingrun export-hf` of the TP 2 checkpoint (shards gathered) loads in transformers, holds the trained (not the
  initial) weights, and transformers on it agrees with `trainingrun score` on the checkpoint (≤ 1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.localrun import finish, records, start
from tests.services import rank_group

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
TOL = 1e-4


def make_hf_model(out: Path, *, seed: int = 0, **overrides) -> Path:
    """A random Llama-architecture model saved by transformers (GQA 4 heads / 2 KV heads, untied, RoPE base 5e4)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=50000.0,
               tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
            if p.ndim == 1:
                p.add_(1.0)  # norm weights around 1, as trained models have
    model.save_pretrained(out)
    return out


def hf_logprobs(model_dir: Path, lines: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for toks in lines:
        ids = torch.tensor(toks)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
        out.append(logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
    return out


def score(model: Path, lines: list[list[int]], tmp: Path) -> list[list[float]]:
    inp, outp = tmp / "score-in.jsonl", tmp / "score-out.jsonl"
    inp.write_text("".join(json.dumps({"tokens": t}) + "\n" for t in lines))
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "score", "--model", str(model), "--input", str(inp),
                           "--output", str(outp)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x)["logprobs"] for x in outp.read_text().splitlines()]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


LINES = [[5], [1, 2], [3, 9, 27, 17, 51, 25, 11], list(range(40)), [63, 0, 63, 0, 7]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf") / "model")


@pytest.mark.megatron
@pytest.mark.parametrize("world", [1, 2])
def test_hf_to_megatron_to_hf_is_bit_exact(hf_dir: Path, tmp_path: Path, world: int) -> None:
    import torch
    from safetensors.torch import load_file

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling import convert

    rank_group([sys.executable, __file__, str(hf_dir), str(tmp_path)], world, timeout=300)
    arch = ModelSpec(hf=str(hf_dir)).resolved()
    shards = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    if world == 2:  # each rank really holds a shard
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] == arch.vocab_size // 2
    full = {n: convert.gather_tp(n, [s[n] for s in shards], arch) for n in shards[0]}
    back = convert.megatron_to_hf(full, arch)
    original = load_file(str(hf_dir / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.megatron
def test_score_on_an_hf_directory_matches_transformers(hf_dir: Path, tmp_path: Path) -> None:
    diff = max_diff(score(hf_dir, LINES, tmp_path), hf_logprobs(hf_dir, LINES))
    print(f"score vs transformers (random HF weights): max |Δ logprob| {diff:.2e}")
    assert diff <= TOL


def _spec(path: Path, hf: Path, tp: int) -> Path:
    path.write_text(f"""
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {{name: hf-tp{tp}}}
spec:
  seed: 5
  model: {{hf: {hf}, seqLength: 64}}
  trainer:
    replicas: {tp}
    tensorParallelSize: {tp}
    maxTokensPerGPU: 512
    optimizer: {{lr: 0.003, clipGrad: 0.0}}
    checkpoint: {{interval: 0, path: checkpoints}}
  rollout:
    source: {{type: synthetic, synthetic: {{task: reverse, minLength: 4, maxLength: 12, vocabSize: 16}}}}
    samplesPerRollout: 32
    groupSize: 4
    numRollouts: 3
  metrics: {{enabled: false}}
""")
    return path


@pytest.mark.megatron
def test_hf_initialised_run_at_tp2_trains_like_tp1_and_exports(hf_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    losses = {}
    for tp in (1, 2):
        out = tmp_path / f"run-tp{tp}"
        code, log = finish(start(_spec(tmp_path / f"tp{tp}.yaml", hf_dir, tp), out))
        assert code == 0, log[-4000:]
        losses[tp] = [r["loss"] for r in records(out)]
    assert len(losses[1]) == 3
    for a, b in zip(losses[2], losses[1], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), losses
    assert losses[1][-1] < losses[1][0]

    ckpt = tmp_path / "run-tp2" / "checkpoints"
    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "export-hf", str(ckpt), "--out", str(export)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in export.iterdir()}
    trained, initial = load_file(str(export / "model.safetensors")), load_file(str(hf_dir / "model.safetensors"))
    assert set(trained) == set(initial)
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
    diff = max_diff(score(ckpt, LINES, tmp_path), hf_logprobs(export, LINES))
    print(f"score(TP2 checkpoint) vs transformers(export-hf): max |Δ logprob| {diff:.2e}")
    assert diff <= TOL


# ---------------------------------------------------------------------------------------------- subprocess worker
def _worker(hf: str, out: str) -> None:
    from trainingrun.modeling.model import build_model, init_distributed, prepare_device, set_seed

    world = int(os.environ["WORLD_SIZE"])
    device = prepare_device(0)
    init_distributed(device, tp=world)
    import torch
    import torch.distributed as dist

    from trainingrun.api.spec.model import ModelSpec
    from trainingrun.modeling.convert import canonical_names

    set_seed(1)
    model = build_model(ModelSpec(hf=hf).resolved(), device)
    torch.save(canonical_names(model.state_dict()), Path(out) / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
    from trainingrun.modeling.model import end_distributed  # deferred: torch, the CPU shim

    end_distributed()  # as Trainer.close: no gloo group left to the interpreter's finalisation
