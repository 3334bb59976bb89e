"""Writes examples/data/agent-model: the tiny model examples/agent.yaml starts from (a Hugging Face directory:
config.json, model.safetensors, tokenizer.json with a chat template).

    python examples/data/make_agent_model.py [--out examples/data/agent-model] [--tool-share 0.2] [--seed 0]

The tokenizer: one token per word (split at white space): the special tokens, the chat roles, `<calc>`/`</calc>`, the
words of reasoning-gym's `chain_sum` questions and the numbers −99 … 198 (every operand and answer of two-term sums
and differences of numbers below 100). Its chat template renders a message as `ROLE : CONTENT </s>`.

The model: a Llama of 2 layers, hidden size 64 (about 100 k parameters), warm-started for a few hundred steps on
conversations in the task's format, so that it knows the format but not the task: in `--tool-share` of them the
assistant calls the calculator with the question's expression and answers with the tool's result; in the others it
answers at once with a random number (almost always wrong: two-digit sums cannot be guessed). Starting from it, RL on
the calculator environment (examples/agent.yaml) has to find out that calling the tool is what earns the reward: the
tool-call rate, the turns per episode and the reward rise together (docs/rl.md, "Multi-turn").

Needs torch, transformers and tokenizers (the `hf` extra); deterministic for a seed on one machine.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["user", "assistant", "tool", ":", "<calc>", "</calc>", "+", "-", "=", "error:",
         "State", "the", "final", "answer", "to", "following", "arithmetic", "problem:"]
NUMBERS = [str(n) for n in range(-99, 199)]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
QUESTION = "State the final answer to the following arithmetic problem: {a} {op} {b} ="


def vocabulary() -> dict[str, int]:
    return {w: i for i, w in enumerate(SPECIAL + WORDS + NUMBERS)}


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)


def conversation(rng: random.Random, tool: bool) -> list[dict[str, str]]:
    a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
    if rng.random() < 0.5:  # chain_sum draws one-digit numbers too
        a, b = rng.randint(0, 9), rng.randint(0, 9)
    value = a + b if op == "+" else a - b
    messages = [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}]
    if tool:
        messages += [{"role": "assistant", "content": f"<calc> {a} {op} {b} </calc>"},
                     {"role": "tool", "content": str(value)},
                     {"role": "assistant", "content": str(value)}]
    else:
        messages.append({"role": "assistant", "content": str(rng.randint(-99, 198))})
    return messages


def render(messages: list[dict[str, str]]) -> tuple[list[str], list[int]]:
    """Words and loss mask (the assistant's words and the </s> after them) of a conversation, as TEMPLATE renders
    it."""
    words, mask = [], []
    for m in messages:
        head, body = [m["role"], ":"], m["content"].split() + ["</s>"]
        words += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return words, mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "agent-model"))
    p.add_argument("--tool-share", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    rng = random.Random(a.seed)
    vocab = vocabulary()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps, eta_min=3e-4)
    for step in range(a.steps):
        batch = [render(conversation(rng, rng.random() < a.tool_share)) for _ in range(32)]
        width = max(len(w) for w, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for i, (words, mask) in enumerate(batch):
            ids[i, :len(words)] = torch.tensor([vocab[w] for w in words])
            labels[i, :len(words)] = torch.tensor([vocab[w] if m else -100 for w, m in zip(words, mask)])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    (out / "README.md").write_text(
        "The tiny model of examples/agent.yaml, written by examples/data/make_agent_model.py "
        f"(--tool-share {a.tool_share} --steps {a.steps} --seed {a.seed}).\n")
    print(json.dumps({"out": str(out), "vocab": len(vocab),
                      "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
