"""`rollout.source.type: jsonl`: a rollout file of samples already generated and scored, validated line by line.

`load_jsonl` reads the whole file up front (every error as `FILE:LINE: FIELD: what is wrong`); source rollout i is
the next `groups_per_rollout` groups in file order (`JsonlSource`). `jsonl_objects` is the line reader the prompt
files of generated rollouts use too (`rollout/prompts.py`).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainingrun.contract.errors import ConfigError
from trainingrun.modeling.tokenizer import TokenizerError
from trainingrun.rollout.groups import SampleGroup
from trainingrun.rollout.source import ReplaySource

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
    groups: list[SampleGroup] = field(default_factory=list)

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
                SampleGroup(group_id=len(data.groups), tokens=[], loss_masks=[], rewards=np.zeros(0, np.float32),
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


class JsonlSource(ReplaySource):
    """`rollout.source.type: jsonl`: source rollout i = the next `groups_per_rollout` groups in file order."""

    def __init__(self, data: JsonlData, groups_per_rollout: int):
        self.data = data
        self.groups_per_rollout = groups_per_rollout

    def draw(self, index: int) -> list[SampleGroup] | None:
        start = index * self.groups_per_rollout
        if start >= len(self.data.groups):
            return None
        # copies: filters/advantages must not change the loaded data (a rebuilt rollout must be identical)
        return [SampleGroup(g.group_id, g.tokens, g.loss_masks, g.rewards.copy(), g.sample_ids,
                            None if g.advantages is None else g.advantages.copy(), g.has_reward)
                for g in self.data.groups[start : start + self.groups_per_rollout]]
