"""Prompts of generated rollouts (`rollout.source.generate.prompts`) and the tokenizers that turn text into ids.

Every prompt source is a pure function of (spec, source index): source rollout i holds prompts
i·P .. i·P + P − 1 (P = samplesPerRollout / groupSize), so a restarted rollout draws exactly the prompts it would have
drawn, none lost or repeated.

    synthetic     built-in token tasks (ids: 0 pad, 1 separator, 2 end, 3.. content): prompt = content + [1],
                  reference = task(content) + [2]: the completion, stop token included, should be exactly it.
                  Lengths uniform in [minLength, maxLength], contents uniform; seeded by (seed, i).
    reasoningGym  entries of a seeded reasoning-gym dataset (`size` of them, drawn in order and again from the
                  start); prompt = template.format(prompt=question), reference = the entry's answer.
    jsonl         one JSON object per line: `prompt` (text) or `prompt_tokens` (ids), optional `answer`, `meta`;
                  validated up front (FILE:LINE: FIELD: what is wrong); the source ends with the file.

Tokenizers: the model's own (`tokenizer.json` of `spec.model.hf`, `trainingrun.modeling.tokenizer`), else a byte
tokenizer: id = 3 + byte, 2 = end of text (needs model vocabSize >= 259). With `prompts.chat: true` a text prompt is
rendered as one user message through the tokenizer's chat template (with the generation prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainingrun.contract.errors import ConfigError
from trainingrun.modeling.architecture import Architecture
from trainingrun.modeling.tokenizer import TokenizerError, run_tokenizer
from trainingrun.rollout.jsonl import jsonl_objects
from trainingrun.rollout.synthetic import EOS, FIRST_CONTENT, SEP


@dataclass
class Prompt:
    """One prompt of a generated rollout."""

    tokens: np.ndarray  # int32, what the engine is given
    reference: Any  # what the reward compares with (token ids for the built-in tasks, text or a number otherwise)
    index: int  # position in the source (dataset index for reasoning-gym)
    text: str | None = None  # the prompt text (text tasks)
    meta: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------------ tokenizers
class ByteTokenizer:
    """UTF-8 bytes as ids 3..258; 0 pad, 1 separator, 2 end of text."""

    eos_id = EOS
    vocab_size = FIRST_CONTENT + 256

    def encode(self, text: str) -> list[int]:
        return [FIRST_CONTENT + b for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - FIRST_CONTENT for i in ids if FIRST_CONTENT <= int(i) < self.vocab_size).decode(
            "utf-8", errors="replace")


def load_tokenizer(arch: Architecture):
    """The run's tokenizer: model.hf's (`trainingrun.modeling.tokenizer.run_tokenizer`), else the byte tokenizer."""
    hf = arch.hf
    if hf:
        try:
            tok = run_tokenizer(hf)
        except (TokenizerError, OSError) as exc:
            raise ConfigError(str(exc)) from None
        if tok.eos_id is None:
            raise ConfigError(f"model.hf: {hf}: the tokenizer names no end-of-text token (eos_token)")
        return tok
    tok = ByteTokenizer()
    vocab = arch.vocab_size
    if vocab < tok.vocab_size:
        raise ConfigError(
            f"model.vocabSize: {vocab} is too small for text prompts with the byte tokenizer (needs >= "
            f"{tok.vocab_size}); raise vocabSize or give a Hugging Face model (model.hf) with its tokenizer"
        )
    return tok


# ------------------------------------------------------------------------------------------------------ synthetic
def synthetic_answer(task: str, content: np.ndarray, vocab_size: int) -> np.ndarray:
    if task == "copy":
        return content.copy()
    if task == "reverse":
        return content[::-1].copy()
    if task == "sort":
        return np.sort(content)
    if task == "successor":
        n = vocab_size - FIRST_CONTENT
        return ((content - FIRST_CONTENT + 1) % n + FIRST_CONTENT).astype(content.dtype)
    raise ConfigError(f"rollout.source.generate.prompts.synthetic.task: unknown task {task!r}")


class SyntheticPrompts:
    def __init__(self, cfg, *, vocab_size: int, seed: int):
        self.cfg = cfg
        self.vocab = cfg.vocab_size or vocab_size
        if self.vocab > vocab_size:
            raise ConfigError(f"rollout.source.generate.prompts.synthetic.vocabSize: {self.vocab} exceeds model "
                              f"vocabSize {vocab_size}")
        if self.vocab <= FIRST_CONTENT:
            raise ConfigError("rollout.source.generate.prompts.synthetic.vocabSize: needs content ids (>= 4)")
        self.seed = seed

    def draw(self, index: int, count: int) -> list[Prompt]:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, index, 0x9E4])))
        out = []
        for j in range(count):
            n = int(rng.integers(self.cfg.min_length, self.cfg.max_length + 1))
            content = rng.integers(FIRST_CONTENT, self.vocab, size=n).astype(np.int32)
            answer = synthetic_answer(self.cfg.task, content, self.vocab)
            out.append(Prompt(tokens=np.concatenate([content, [SEP]]).astype(np.int32),
                              reference=[*answer.tolist(), EOS], index=index * count + j))
        return out


# ------------------------------------------------------------------------------------------------------ reasoning-gym
def reasoning_gym_dataset(name: str, config: dict[str, Any], seed: int, size: int):
    try:
        import reasoning_gym  # deferred: reasoning_gym (optional, heavy)
    except ImportError:
        raise ConfigError("rollout.source.generate.prompts.reasoningGym: the reasoning-gym package is not "
                          "installed (pip install 'trainingrun[rl]')") from None
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except Exception as exc:  # noqa: BLE001 - the task's own validation: a config error naming the field
        raise ConfigError(f"rollout.source.generate.prompts.reasoningGym: cannot create {name!r} with config "
                          f"{config}: {type(exc).__name__}: {exc}") from None


class ReasoningGymPrompts:
    def __init__(self, cfg, *, seed: int, template: str, tokenizer, chat: bool = False):
        self.chat = chat
        self.params = {"name": cfg.name, "config": dict(cfg.config), "seed": cfg.seed if cfg.seed is not None
                       else seed, "size": cfg.size}
        self.dataset = reasoning_gym_dataset(**self.params)
        self.template, self.tokenizer = template, tokenizer

    def draw(self, index: int, count: int) -> list[Prompt]:
        out = []
        for j in range(count):
            k = (index * count + j) % self.params["size"]
            entry = self.dataset[k]
            text = _format(self.template, entry["question"])
            out.append(Prompt(tokens=encode_prompt(self.tokenizer, text, self.chat), reference=entry["answer"],
                              index=k, text=text))
        return out


# ------------------------------------------------------------------------------------------------------ jsonl
class JsonlPrompts:
    def __init__(self, path: str | Path, *, template: str, tokenizer, vocab_size: int, chat: bool = False):
        self.chat = chat
        self.path = Path(path)
        self.lines = load_prompt_lines(self.path, vocab_size=vocab_size)
        self.template, self.tokenizer = template, tokenizer

    def draw(self, index: int, count: int) -> list[Prompt] | None:
        start = index * count
        if start >= len(self.lines):
            return None
        out = []
        for k in range(start, min(start + count, len(self.lines))):
            line = self.lines[k]
            if "prompt_tokens" in line:
                tokens, text = np.asarray(line["prompt_tokens"], np.int32), None
            else:
                text = _format(self.template, line["prompt"])
                tokens = encode_prompt(self.tokenizer, text, self.chat)
            out.append(Prompt(tokens=tokens, reference=line.get("answer"), index=k, text=text,
                              meta=line.get("meta") or {}))
        return out


PROMPT_FIELDS = ("prompt", "prompt_tokens", "answer", "meta")


def load_prompt_lines(path: Path, *, vocab_size: int) -> list[dict[str, Any]]:
    """Validated prompt lines; ConfigError listing up to 20 errors as `FILE:LINE: FIELD: what is wrong`."""
    errors: list[str] = []
    lines: list[dict[str, Any]] = []
    for _lineno, where, obj in jsonl_objects(Path(path), PROMPT_FIELDS, errors,
                                            field="rollout.source.generate.prompts.jsonl.path"):
        if ("prompt" in obj) == ("prompt_tokens" in obj):
            errors.append(f"{where}: prompt: give exactly one of prompt (text) and prompt_tokens (ids)")
            continue
        if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
            errors.append(f"{where}: prompt: must be a non-empty string")
            continue
        if "prompt_tokens" in obj:
            toks = obj["prompt_tokens"]
            if (not isinstance(toks, list) or not toks
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks)):
                errors.append(f"{where}: prompt_tokens: must be a non-empty list of ints")
                continue
            if min(toks) < 0 or max(toks) >= vocab_size:
                errors.append(f"{where}: prompt_tokens: ids must be in [0, {vocab_size}) (model vocabSize)")
                continue
        if "meta" in obj and not isinstance(obj["meta"], dict):
            errors.append(f"{where}: meta: must be an object")
            continue
        lines.append(obj)
    if not errors and not lines:
        errors.append(f"{path}: no prompts (the file is empty)")
    if errors:
        raise ConfigError("invalid prompts file:\n  " + "\n  ".join(errors))
    return lines


def encode_prompt(tokenizer, text: str, chat: bool) -> np.ndarray:
    """The prompt's token ids; with `chat` the text is one user message rendered by the tokenizer's chat template."""
    if chat:
        render = getattr(tokenizer, "render", None)
        if render is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("rollout.source.generate.prompts.chat: the run's tokenizer has no chat template "
                              "(model.hf's tokenizer_config.json chat_template)")
        text = render([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError(f"rollout.source.generate.prompts: prompt {text[:40]!r} tokenizes to no tokens")
    return np.asarray(ids, np.int32)


def _format(template: str, prompt: str) -> str:
    try:
        return template.format(prompt=prompt)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"rollout.source.generate.prompts.template: {template!r}: {exc!r} (use {{prompt}})") from None


def make_prompts(spec, arch: Architecture, *, tokenizer=None, prompts=None, seed: int | None = None):
    """The prompt source `spec.rollout.source.generate.prompts` names (or `prompts`, a PromptsSpec: the evaluation's,
    seeded by `seed` instead of spec.seed), for the run's model `arch`."""
    p = prompts if prompts is not None else spec.rollout.source.generate.prompts
    seed = spec.seed if seed is None else seed
    vocab = arch.vocab_size
    if p.type == "synthetic":
        return SyntheticPrompts(p.synthetic, vocab_size=vocab, seed=seed)
    tokenizer = tokenizer or load_tokenizer(arch)
    if p.type == "reasoningGym":
        return ReasoningGymPrompts(p.reasoning_gym, seed=seed, template=p.template, tokenizer=tokenizer,
                                   chat=p.chat)
    return JsonlPrompts(p.jsonl.path, template=p.template, tokenizer=tokenizer, vocab_size=vocab, chat=p.chat)
