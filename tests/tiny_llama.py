"""A tiny random Llama saved by `transformers` as an HF directory (config.json, model.safetensors, tokenizer.json).

Run with the Python of vLLM's environment (it has transformers; the project's test venv may not):
    .venv-vllm/bin/python tests/tiny_llama.py OUT_DIR [--seed N] [--perturb-from DIR --scale S]
`--perturb-from DIR` writes DIR's weights plus seeded noise (S × each matrix's std) instead of a fresh model: "new
weights" for weight-sync tests. `--logprobs FILE.json --tokens 5,6,7` writes, for the model OUT_DIR (several:
comma-separated), the fp32 `transformers` log-probabilities of the sequence (log p(token i | tokens < i), i >= 1):
the reference an engine's logprobs are compared with.

Sizes: vLLM's CPU attention needs head_dim in {32, 64, 80, ...}: hidden 128 with 4 heads (2 KV heads) gives 32.
`--hidden 64` gives head_dim 16, a model vLLM's CPU attention refuses at its first request (tests of that failure).
Vocabulary: 512 word-level tokens "<pad>" 0, "<sep>" 1, "</s>" 2, "t3" ... "t511" (the synthetic tasks' ids).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

VOCAB = 512


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<sep>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<sep>",
                            unk_token="<pad>").save_pretrained(out)


def make_model(out: Path, seed: int, tied: bool, hidden: int = 128) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)


def perturb(src: Path, out: Path, seed: int, scale: float) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    if out.resolve() != src.resolve():
        shutil.copytree(src, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(src / "model.safetensors"))
    new = {k: (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous() if v.dim() > 1 else v
           for k, v in sd.items()}
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})


def logprobs(model_dir: Path, tokens: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, tokens[i]]) for i in range(1, len(tokens))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (4 heads, 2 KV heads)")
    p.add_argument("--perturb-from")
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--logprobs", help="write the reference logprobs of --tokens under model OUT here")
    p.add_argument("--tokens")
    a = p.parse_args()
    out = Path(a.out)
    if a.logprobs:
        tokens = [int(t) for t in a.tokens.split(",")]
        Path(a.logprobs).write_text(json.dumps({d: logprobs(Path(d), tokens) for d in a.out.split(",")}))
        return
    out.mkdir(parents=True, exist_ok=True)
    if a.perturb_from:
        perturb(Path(a.perturb_from), out, a.seed, a.scale)
    else:
        make_tokenizer(out)
        make_model(out, a.seed, a.tied, a.hidden)


if __name__ == "__main__":
    main()
