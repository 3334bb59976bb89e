"""Sample sources of the rollout program: `synthetic` (a seeded, learnable task) and `jsonl` (pre-tokenized).

A source yields groups (`Group`): the samples generated for one prompt. A sample is a token sequence with a loss
mask where `loss_mask[t] = 1` means token t is a training target, predicted from the tokens before it (so
`loss_mask[0]` is always 0), plus a reward and, for jsonl, optionally a given advantage.

Synthetic task (token ids: 0 pad, 1 separator, 2 end of answer, 3.. content):
    sample = prompt + [SEP] + response + [EOS], response = task(prompt) with some tokens corrupted.
    The loss mask covers response and EOS. Prompt lengths follow a truncated Pareto law (alpha 1.2) between
    minLength and maxLength: mostly short, a heavy tail of long ones. Each of the groupSize samples of a group
    gets its own corruption rate (uniform in [0, 0.6)); each answer token is replaced by a different random token
    with that probability; reward = fraction of answer tokens that are correct. With probability 0.2 a group's
    samples are all identical (as when a policy is confident), so the zero-variance filter drops it.
    Everything is drawn from a generator seeded by (spec.seed, source index): rollout i is the same whatever
    happened before, which makes restarts deterministic.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

PAD, SEP, EOS = 0, 1, 2
FIRST_CONTENT = 3
PARETO_ALPHA = 1.2
IDENTICAL_GROUP_P = 0.2
MAX_CORRUPTION = 0.6


class ConfigError(ValueError):
    """A configuration or input-data error: the rollout exits with EXIT_CONFIG_ERROR (no restart can fix it)."""


@dataclass
class Group:
    """The samples of one prompt. `advantages` is None until computed (or given by a jsonl source)."""

    group_id: int
    tokens: list[np.ndarray]  # int32 each
    loss_masks: list[np.ndarray]  # uint8 each
    rewards: np.ndarray  # float32 [n]
    sample_ids: np.ndarray  # int64 [n]
    advantages: np.ndarray | None = None  # float32 [n]
    has_reward: bool = True  # jsonl lines may give only an advantage
    # generated rollouts only: the generator's log-probability of each token (0 on the prompt) and weight versions
    logprobs: list[np.ndarray] | None = None  # float32 each, same length as the tokens
    versions: np.ndarray | None = None  # int64 [n]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    # ---- JSON form (rollout resume state): arrays as base64 of their little-endian bytes, never pickle
    def to_json(self) -> dict[str, Any]:
        offsets = np.zeros(len(self) + 1, np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        b64 = lambda a: base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()  # noqa: E731
        return {
            "group_id": int(self.group_id),
            "offsets": offsets.tolist(),
            "tokens": b64(np.concatenate(self.tokens).astype("<i4")),
            "loss_mask": b64(np.concatenate(self.loss_masks).astype(np.uint8)),
            "rewards": b64(self.rewards.astype("<f4")),
            "sample_ids": b64(self.sample_ids.astype("<i8")),
            "advantages": None if self.advantages is None else b64(self.advantages.astype("<f4")),
            "has_reward": self.has_reward,
            "logprobs": None if self.logprobs is None else b64(np.concatenate(self.logprobs).astype("<f4")),
            "versions": None if self.versions is None else b64(self.versions.astype("<i8")),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Group:
        dec = lambda s, dt: np.frombuffer(base64.b64decode(s), dtype=dt).copy()  # noqa: E731
        offsets = d["offsets"]
        tokens, masks = dec(d["tokens"], "<i4").astype(np.int32), dec(d["loss_mask"], np.uint8)
        spans = list(zip(offsets[:-1], offsets[1:]))
        return cls(
            group_id=int(d["group_id"]),
            tokens=[tokens[a:b] for a, b in spans],
            loss_masks=[masks[a:b] for a, b in spans],
            rewards=dec(d["rewards"], "<f4").astype(np.float32),
            sample_ids=dec(d["sample_ids"], "<i8").astype(np.int64),
            advantages=None if d.get("advantages") is None else dec(d["advantages"], "<f4").astype(np.float32),
            has_reward=bool(d.get("has_reward", True)),
            logprobs=None if d.get("logprobs") is None else
            [a.copy() for a in np.split(dec(d["logprobs"], "<f4").astype(np.float32), offsets[1:-1])],
            versions=None if d.get("versions") is None else dec(d["versions"], "<i8").astype(np.int64),
        )


# ------------------------------------------------------------------------------------------------------- synthetic
def truncated_pareto_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, alpha: float = PARETO_ALPHA) -> np.ndarray:
    """n integer lengths in [lo, hi], density ∝ x^-(alpha+1) (inverse-CDF sampling of a truncated Pareto law)."""
    if lo == hi:
        return np.full(n, lo, dtype=np.int64)
    u = rng.random(n)
    upper = hi + 1  # floor() then reaches hi
    x = lo / (1.0 - u * (1.0 - (lo / upper) ** alpha)) ** (1.0 / alpha)
    return np.clip(np.floor(x).astype(np.int64), lo, hi)


def task_answer(task: str, prompt: np.ndarray) -> np.ndarray:
    if task == "reverse":
        return prompt[::-1].copy()
    if task == "sort":
        return np.sort(prompt)
    if task == "copy":
        return prompt.copy()
    raise ConfigError(f"rollout.source.synthetic.task: unknown task {task!r}; allowed: reverse, sort, copy")


@dataclass(frozen=True)
class SyntheticConfig:
    task: str
    min_length: int
    max_length: int
    vocab_size: int
    group_size: int
    groups_per_rollout: int
    seed: int


def synthetic_rollout(cfg: SyntheticConfig, source_index: int) -> list[Group]:
    """The groups of synthetic rollout `source_index`; a pure function of (cfg, source_index)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([cfg.seed, source_index, 0x7A11])))
    n_content = cfg.vocab_size - FIRST_CONTENT
    lengths = truncated_pareto_lengths(rng, cfg.groups_per_rollout, cfg.min_length, cfg.max_length)
    groups = []
    gs = cfg.group_size
    for g, plen in enumerate(lengths):
        prompt = rng.integers(FIRST_CONTENT, cfg.vocab_size, size=int(plen)).astype(np.int32)
        answer = task_answer(cfg.task, prompt)
        identical = rng.random() < IDENTICAL_GROUP_P
        rates = rng.uniform(0.0, MAX_CORRUPTION, size=gs)
        toks, masks, rewards = [], [], np.empty(gs, np.float32)
        for i in range(gs):
            if identical and i > 0:
                toks.append(toks[0].copy())
                masks.append(masks[0].copy())
                rewards[i] = rewards[0]
                continue
            wrong = rng.random(int(plen)) < rates[i]
            # a different token: shift by 1..n_content-1 within the content range
            shift = rng.integers(1, max(n_content, 2), size=int(plen))
            response = answer.copy()
            if n_content > 1:
                response[wrong] = (answer[wrong] - FIRST_CONTENT + shift[wrong]) % n_content + FIRST_CONTENT
            else:
                wrong[:] = False
            tokens = np.concatenate([prompt, [SEP], response, [EOS]]).astype(np.int32)
            mask = np.zeros(len(tokens), np.uint8)
            mask[int(plen) + 1 :] = 1  # response tokens and EOS are targets
            toks.append(tokens)
            masks.append(mask)
            rewards[i] = 1.0 - wrong.mean()
        gid = source_index * cfg.groups_per_rollout + g
        ids = np.arange(gid * gs, (gid + 1) * gs, dtype=np.int64)
        groups.append(Group(group_id=gid, tokens=toks, loss_masks=masks, rewards=rewards, sample_ids=ids))
    return groups


# ------------------------------------------------------------------------------------------------------------ jsonl
JSONL_FIELDS = ("group", "tokens", "loss_mask", "prompt_length", "prompt", "response", "messages", "reward",
                "advantage", "meta")
TEXT_FIELDS = ("prompt", "response", "messages")
MAX_REPORTED_ERRORS = 20


def _number(value: Any) -> bool:
    """A finite JSON number (an integer too large for a float is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


MAX_LINE_BYTES = 64 * 1024 * 1024  # one jsonl line (a sample); longer is refused, not read into memory


def _jsonl_lines(path: Path, field: str):
    """(line number, text or None, error message or None) of a jsonl file, read in binary: a line that is not UTF-8
    or longer than MAX_LINE_BYTES is an error for that line, not an exception; a FIFO or device is refused without
    blocking. A file that cannot be opened is a ConfigError naming `field`."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise ConfigError(f"{field}: cannot open {path}{where}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{field}: {path} is not a regular file")
    with os.fdopen(fd, "rb") as fh:
        lineno = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line without keeping it
                    raw = fh.readline(MAX_LINE_BYTES)
                yield lineno, None, f"longer than {MAX_LINE_BYTES} bytes: refused"
                continue
            try:
                yield lineno, raw.decode("utf-8"), None
            except UnicodeDecodeError as exc:
                yield lineno, None, f"not UTF-8 text (byte {exc.start + 1} of the line: {exc.reason})"


@dataclass
class JsonlData:
    """A validated jsonl file: its groups in file order."""

    path: Path
    groups: list[Group] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(len(g) for g in self.groups)


def load_jsonl(path: str | Path, *, vocab_size: int, tokenizer: Callable[[], Any] | None = None) -> JsonlData:
    """Read and validate a rollout file, line by line.

    Each non-empty line is a JSON object with at least one of `reward` and `advantage` (finite numbers), optionally
    `meta` (ignored), and one of three sample forms:
      * tokens: `group` (int or string; a group's lines are contiguous), `tokens` (list of >= 2 ints in
        [0, vocab_size)), exactly one of `loss_mask` (list of 0/1, same length, loss_mask[0] == 0) and
        `prompt_length` (int in [1, len(tokens)): targets are the tokens after the prompt);
      * text: `prompt` and `response` (strings), tokenised with the run's tokenizer: prompt tokens (with the
        tokenizer's own special tokens, e.g. BOS) + response tokens + EOS; the loss mask covers response and EOS;
      * chat: `messages` (a list of {"role", "content"} with at least one assistant message), rendered with the
        tokenizer's chat template; the loss mask covers the assistant messages.
    In the text and chat forms `group` is optional (default: the line is a group of its own).
    `tokenizer()` returns the run's tokenizer (`trainingrun.modeling.tokenizer.RunTokenizer`) or raises ConfigError;
    it is called only when a text or chat line appears. Any other field is an error.
    Raises ConfigError listing up to 20 errors as `FILE:LINE: FIELD: what is wrong (what is allowed)`.
    """
    path = Path(path)
    errors: list[str] = []
    data = JsonlData(path=path)
    seen_groups: dict[Any, int] = {}
    current_key: Any = object()
    for lineno, where, obj in jsonl_objects(path, JSONL_FIELDS, errors, field="rollout.source.jsonl.path"):
        if any(k in obj for k in TEXT_FIELDS):
            sample = _text_line(obj, where, vocab_size, errors, tokenizer)
        else:
            sample = _validate_line(obj, where, vocab_size, errors)
        if sample is None:
            continue
        key = obj.get("group", f"\0line {lineno}")
        if key != current_key:
            if key in seen_groups:
                errors.append(
                    f"{where}: group: {key!r} appeared before (line {seen_groups[key]}) and again after another "
                    "group; a group's lines must be contiguous"
                )
                continue
            seen_groups[key] = lineno
            current_key = key
            data.groups.append(
                Group(group_id=len(data.groups), tokens=[], loss_masks=[], rewards=np.zeros(0, np.float32),
                      sample_ids=np.zeros(0, np.int64), advantages=np.zeros(0, np.float32))
            )
        tokens, mask, reward, advantage = sample
        g = data.groups[-1]
        g.tokens.append(tokens)
        g.loss_masks.append(mask)
        g.rewards = np.append(g.rewards, np.float32(0.0 if reward is None else reward))
        g.sample_ids = np.append(g.sample_ids, np.int64(lineno - 1))
        g.advantages = np.append(g.advantages, np.float32(np.nan if advantage is None else advantage))
        g.has_reward = g.has_reward and reward is not None
    if not errors and not data.groups:
        errors.append(f"{path}: no samples (the file is empty)")
    if errors:
        raise ConfigError("invalid jsonl rollout file:\n  " + "\n  ".join(errors))
    for g in data.groups:
        if np.isnan(g.advantages).any():
            if not np.isnan(g.advantages).all():
                first = int(g.sample_ids[0]) + 1
                raise ConfigError(
                    f"{path}:{first}: advantage: group starting at line {first} gives advantage on some lines only; "
                    "give it on every line of a group or on none"
                )
            g.advantages = None
    return data


def _reward_fields(obj: dict, where: str, errors: list[str]) -> tuple[Any, Any]:
    reward, advantage = obj.get("reward"), obj.get("advantage")
    if reward is None and advantage is None:
        errors.append(f"{where}: reward: give reward or advantage (or both)")
    for name, value in (("reward", reward), ("advantage", advantage)):
        if value is not None and not _number(value):
            errors.append(f"{where}: {name}: must be a finite number, got {value!r}")
    return reward, advantage


def _text_line(obj: dict, where: str, vocab: int, errors: list[str], tokenizer: Callable[[], Any] | None):
    """A `prompt`/`response` or `messages` line → (tokens, mask, reward, advantage), or None with errors added."""
    start = len(errors)
    for k in ("tokens", "loss_mask", "prompt_length"):
        if k in obj:
            errors.append(f"{where}: {k}: not allowed in a text line (give tokens, prompt/response or messages)")
    if "group" in obj and (not isinstance(obj["group"], (int, str)) or isinstance(obj["group"], bool)):
        errors.append(f"{where}: group: must be an int or a string, got {type(obj['group']).__name__}")
    chat = "messages" in obj
    if chat and ("prompt" in obj or "response" in obj):
        errors.append(f"{where}: messages: give either messages or prompt and response, not both")
    elif chat:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            errors.append(f"{where}: messages: must be a non-empty list of {{\"role\": str, \"content\": str}}")
    else:
        for k in ("prompt", "response"):
            if not isinstance(obj.get(k), str) or not obj.get(k):
                errors.append(f"{where}: {k}: must be a non-empty string (a text line needs prompt and response)")
    reward, advantage = _reward_fields(obj, where, errors)
    if len(errors) > start:
        return None
    if tokenizer is None:
        errors.append(f"{where}: {'messages' if chat else 'prompt'}: text lines need the run's tokenizer: set "
                      "model.hf to a Hugging Face directory with tokenizer.json")
        return None
    from trainingrun.modeling.tokenizer import TokenizerError

    try:
        tok = tokenizer()
        tokens, mask = tok.chat(obj["messages"]) if chat else tok.prompt_response(obj["prompt"], obj["response"])
    except (TokenizerError, ConfigError) as exc:
        errors.append(f"{where}: {exc}")
        return None
    if int(tokens.max()) >= vocab:
        errors.append(f"{where}: tokens: the tokenizer gave id {int(tokens.max())}, outside the model's vocabulary "
                      f"[0, {vocab})")
        return None
    return tokens, mask, reward, advantage


def jsonl_objects(path: Path, allowed: tuple[str, ...], errors: list[str], *, field: str):
    """(line number, "FILE:LINE", object) for each JSON-object line of a jsonl file with only `allowed` fields.

    Bad lines (not JSON, not an object, unknown fields) are appended to `errors` as `FILE:LINE: what is wrong` and
    skipped, as are lines that are not UTF-8 or too long (`_jsonl_lines`); blank lines are skipped; reading stops
    after MAX_REPORTED_ERRORS errors. A file that cannot be opened (or is no regular file) is a ConfigError naming
    `field`."""
    for lineno, line, problem in _jsonl_lines(path, field):
        if len(errors) >= MAX_REPORTED_ERRORS:
            errors.append(f"{path}: stopped after {MAX_REPORTED_ERRORS} errors")
            return
        where = f"{path}:{lineno}"
        if problem is not None:
            errors.append(f"{where}: {problem}")
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            errors.append(f"{where}: not valid JSON: {exc}")
            continue
        except RecursionError:
            errors.append(f"{where}: not valid JSON: nested too deeply")
            continue
        if not isinstance(obj, dict):
            errors.append(f"{where}: must be a JSON object, got {type(obj).__name__}")
            continue
        bad = [f"{where}: {k}: unknown field (allowed: {', '.join(allowed)})" for k in obj if k not in allowed]
        if bad:
            errors.extend(bad)
            continue
        yield lineno, where, obj


def _validate_line(obj: dict, where: str, vocab: int, errors: list[str]):
    start = len(errors)
    if "group" not in obj:
        errors.append(f"{where}: group: missing (an int or string naming the prompt's group)")
    elif not isinstance(obj["group"], (int, str)) or isinstance(obj["group"], bool):
        errors.append(f"{where}: group: must be an int or a string, got {type(obj['group']).__name__}")
    tokens = obj.get("tokens")
    arr = None
    if tokens is None:
        errors.append(f"{where}: tokens: missing (a list of token ids)")
    elif not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        errors.append(f"{where}: tokens: must be a list of ints")
    elif len(tokens) < 2:
        errors.append(f"{where}: tokens: needs at least 2 tokens (a prompt token and a target), got {len(tokens)}")
    else:
        lo, hi = min(tokens), max(tokens)  # checked as Python ints: an id beyond int64 is out of range, not a crash
        if lo < 0 or hi >= vocab:
            errors.append(f"{where}: tokens: ids must be in [0, {vocab}) (model vocabSize), got {lo}..{hi}")
        else:
            arr = np.asarray(tokens, dtype=np.int64)
    mask = None
    has_mask, has_pl = "loss_mask" in obj, "prompt_length" in obj
    if has_mask == has_pl:
        errors.append(f"{where}: loss_mask: give exactly one of loss_mask and prompt_length")
    elif has_mask:
        m = obj["loss_mask"]
        if not isinstance(m, list) or not all(type(v) is int and v in (0, 1) for v in m):
            errors.append(f"{where}: loss_mask: must be a list of 0/1")
        elif arr is not None and len(m) != len(arr):
            errors.append(f"{where}: loss_mask: length {len(m)} != tokens length {len(arr)}")
        elif m and m[0] != 0:
            errors.append(f"{where}: loss_mask: loss_mask[0] must be 0 (the first token has nothing to be predicted from)")
        elif not any(m):
            errors.append(f"{where}: loss_mask: has no target token (all 0)")
        else:
            mask = np.asarray(m, dtype=np.uint8)
    else:
        pl = obj["prompt_length"]
        if not isinstance(pl, int) or isinstance(pl, bool):
            errors.append(f"{where}: prompt_length: must be an int")
        elif arr is not None and not 1 <= pl < len(arr):
            errors.append(f"{where}: prompt_length: must be in [1, {len(arr)}) (tokens length), got {pl}")
        elif arr is not None:
            mask = np.zeros(len(arr), np.uint8)
            mask[pl:] = 1
    reward, advantage = _reward_fields(obj, where, errors)
    if len(errors) > start or arr is None or mask is None:
        return None
    return arr.astype(np.int32), mask, reward, advantage


# ------------------------------------------------------------------------------------------------------ sources
class Source(Protocol):
    """The first three stages of a rollout: draw prompts → generate → score.

    `draw(i)` returns source rollout i's prompts (None: the source is exhausted); `generate` turns them into groups
    of samples; `score` sets the groups' rewards. `close()` releases what the source holds (engine, reward workers).
    The replay sources (`synthetic`, `jsonl`: `ReplaySource`) draw samples that are already generated and scored.
    """

    def draw(self, index: int) -> Any | None: ...

    def generate(self, prompts: Any, rollout: int) -> list[Group]:
        """The samples of `prompts`, for published rollout `rollout` (generated sources pick the weights by it)."""

    def score(self, groups: list[Group]) -> None: ...

    def close(self) -> None: ...


class ReplaySource:
    """A source whose draws are samples already generated and scored: `generate` and `score` pass them through, and
    a source rollout is a pure function of (spec, i), so a rollout lost by the store can be rebuilt bit for bit."""

    replayable = True

    def generate(self, prompts: list[Group], rollout: int) -> list[Group]:
        return prompts

    def score(self, groups: list[Group]) -> None:
        pass

    def close(self) -> None:
        pass


class SyntheticSource(ReplaySource):
    """`rollout.source.type: synthetic` (see the module docstring)."""

    def __init__(self, cfg: SyntheticConfig):
        self.cfg = cfg

    def draw(self, index: int) -> list[Group]:
        return synthetic_rollout(self.cfg, index)


class JsonlSource(ReplaySource):
    """`rollout.source.type: jsonl`: source rollout i = the next `groups_per_rollout` groups in file order."""

    def __init__(self, data: JsonlData, groups_per_rollout: int):
        self.data = data
        self.groups_per_rollout = groups_per_rollout

    def draw(self, index: int) -> list[Group] | None:
        start = index * self.groups_per_rollout
        if start >= len(self.data.groups):
            return None
        # copies: filters/advantages must not change the loaded data (a rebuilt rollout must be identical)
        return [Group(g.group_id, g.tokens, g.loss_masks, g.rewards.copy(), g.sample_ids,
                      None if g.advantages is None else g.advantages.copy(), g.has_reward)
                for g in self.data.groups[start : start + self.groups_per_rollout]]
