"""The run's tokenizer: `tokenizer.json` of the `spec.model.hf` directory (through `tokenizers`), and its chat template
(`chat_template.jinja`, or `chat_template` in tokenizer_config.json) rendered with jinja2 in a sandbox, as
transformers renders it (trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`).

Two ways to turn text into a training sample (the jsonl source's text lines, docs/rollout):
  * `prompt_response(prompt, response)`: tokens(prompt, with the tokenizer's own special tokens such as BOS) +
    tokens(response) + EOS; the loss mask covers the response and the EOS.
  * `chat(messages)`: the chat template applied to the conversation; the loss mask covers what the template renders
    for each assistant message (its content and the end-of-turn marker after it), found by rendering the
    conversation up to that message with and without it: a template whose earlier output changes when a later
    message is added is refused, since no mask could be right for it.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class TokenizerError(ValueError):
    pass


@dataclass
class RunTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    special: dict[str, str]  # bos_token, eos_token, ... as strings
    eos_id: int | None
    source: str

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> RunTokenizer:
        from tokenizers import Tokenizer  # deferred: tokenizers

        d = Path(hf_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"model.hf: {path} not found (text jsonl lines need the model's tokenizer.json)")
        tok = Tokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        eos = special.get("eos_token")
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is None and (d / "config.json").is_file():
            cfg_eos = json.loads((d / "config.json").read_text()).get("eos_token_id")
            eos_id = cfg_eos[0] if isinstance(cfg_eos, list) else cfg_eos
        return cls(tokenizer=tok, chat_template=template, special=special, eos_id=eos_id, source=str(d))

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -------------------------------------------------------------------------------------------- samples
    def prompt_response(self, prompt: str, response: str) -> tuple[np.ndarray, np.ndarray]:
        p = self.encode(prompt, special=True)
        r = self.encode(response)
        if self.eos_id is not None:
            r.append(int(self.eos_id))
        if not p:
            raise TokenizerError("prompt: tokenizes to no tokens (a sample needs a token before its first target)")
        if not r:
            raise TokenizerError("response: tokenizes to no tokens")
        tokens = np.asarray(p + r, dtype=np.int32)
        mask = np.zeros(len(tokens), np.uint8)
        mask[len(p):] = 1
        return tokens, mask

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[Any] | None = None) -> str:
        """The chat template's text of `messages` (with `tools`, for templates that render them, as transformers
        passes them)."""
        if not self.chat_template:
            raise TokenizerError(f"messages: the tokenizer in {self.source} has no chat template "
                                 "(tokenizer_config.json chat_template or chat_template.jinja)")
        import jinja2  # deferred: jinja2, chat templates only
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: jinja2

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"messages: the chat template refused the conversation: {message}")

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   **self.special)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"messages: the chat template failed: {exc}") from None

    def chat(self, messages: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not upto.startswith(before) or not full.startswith(upto):
                raise TokenizerError(f"messages: the chat template renders message {i} so that earlier text changes; "
                                     "cannot tell which tokens are the assistant's")
            spans.append((len(before), len(upto)))
        if not spans:
            raise TokenizerError("messages: no assistant message (nothing to train on)")
        enc = self.tokenizer.encode(full, add_special_tokens=False)
        ids = list(enc.ids)
        mask = np.zeros(len(ids), np.uint8)
        for t, (start, _end) in enumerate(enc.offsets):
            if any(a <= start < b for a, b in spans):
                mask[t] = 1
        if len(ids) < 2 or mask[0]:
            raise TokenizerError("messages: the conversation must render to a prompt before the first assistant token")
        if not mask.any():
            raise TokenizerError("messages: the assistant messages render to no tokens")
        return np.asarray(ids, dtype=np.int32), mask


_CACHE: dict[str, RunTokenizer] = {}


def run_tokenizer(hf_dir: str | Path) -> RunTokenizer:
    key = str(Path(hf_dir).resolve())
    if key not in _CACHE:
        _CACHE[key] = RunTokenizer.from_hf_dir(hf_dir)
    return _CACHE[key]
