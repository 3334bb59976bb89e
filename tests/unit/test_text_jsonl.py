"""Text and chat lines of the jsonl source: the run's tokenizer, its chat template, and the loss mask on responses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainingrun.modeling.tokenizer import RunTokenizer, TokenizerError
from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.jsonl import load_jsonl

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = "what is 2 + 3 ? 5 . 7 4 11 and system user assistant be brief answer : question the sum".split()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny word-level tokenizer.json (with BOS added by its post-processor) and a ChatML chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    d = tmp_path_factory.mktemp("tok")
    special = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special + WORDS + ["Be", "brief.", "\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    tok.add_special_tokens(special)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "chat_template": CHATML}))
    return d


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_prompt_response_masks_the_response_and_eos(hf_dir):
    tok = RunTokenizer.from_hf_dir(hf_dir)
    tokens, mask = tok.prompt_response("what is 2 + 3 ?", "5 .")
    words = [tok.tokenizer.id_to_token(int(t)) for t in tokens]
    assert words == ["<s>", "what", "is", "2", "+", "3", "?", "5", ".", "<|im_end|>"]
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]


def test_chat_masks_assistant_turns_only_and_matches_transformers(hf_dir):
    tok = RunTokenizer.from_hf_dir(hf_dir)
    messages = [{"role": "user", "content": "what is 2 + 3 ?"}, {"role": "assistant", "content": "5 ."},
                {"role": "user", "content": "and 7 + 4 ?"}, {"role": "assistant", "content": "11 ."}]
    tokens, mask = tok.chat(messages)
    words = [tok.tokenizer.id_to_token(int(t)) for t in tokens]
    trained = [w for w, m in zip(words, mask) if m]
    assert trained == ["5", ".", "<|im_end|>", "11", ".", "<|im_end|>"]
    assert words[:2] == ["<|im_start|>", "system"] and not mask[: words.index("5")].any()
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir)).apply_chat_template(messages, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert tokens.tolist() == list(ref)


def test_jsonl_mixes_token_text_and_chat_lines(hf_dir, tmp_path):
    tok = RunTokenizer.from_hf_dir(hf_dir)
    path = write(tmp_path / "d.jsonl", [
        {"group": "a", "tokens": [5, 6, 7], "prompt_length": 1, "reward": 1.0},
        {"group": "a", "tokens": [5, 6, 8], "prompt_length": 1, "reward": 0.0},
        {"prompt": "what is 2 + 3 ?", "response": "5 .", "reward": 0.5},
        {"messages": [{"role": "user", "content": "what is 2 + 3 ?"}, {"role": "assistant", "content": "5 ."}],
         "reward": 1.0, "meta": {"id": 3}},
        {"group": "g", "prompt": "the sum ?", "response": "5", "advantage": 0.25},
        {"group": "g", "prompt": "the sum ?", "response": "7", "advantage": -0.25},
    ])
    data = load_jsonl(path, vocab_size=100, tokenizer=lambda: tok)
    assert [len(g) for g in data.groups] == [2, 1, 1, 2]  # ungrouped text lines are groups of their own
    text = data.groups[1]
    assert text.loss_masks[0].sum() == 3 and text.rewards.tolist() == [0.5]
    assert data.groups[3].advantages.tolist() == [0.25, -0.25]


@pytest.mark.parametrize("line,expect", [
    ({"prompt": "what", "reward": 1.0}, "response: must be a non-empty string"),
    ({"prompt": "what", "response": "5", "tokens": [1, 2], "reward": 1.0}, "tokens: not allowed in a text line"),
    ({"messages": [{"role": "user", "content": "what"}], "reward": 1.0}, "messages: no assistant message"),
    ({"messages": "hi", "reward": 1.0}, "messages: must be a non-empty list"),
    ({"messages": [{"role": "assistant", "content": "5"}], "prompt": "x", "reward": 1.0}, "messages: give either"),
    ({"prompt": "what", "response": "5"}, "reward: give reward or advantage"),
])
def test_bad_text_lines_name_file_line_and_field(hf_dir, tmp_path, line, expect):
    tok = RunTokenizer.from_hf_dir(hf_dir)
    path = write(tmp_path / "bad.jsonl", [{"prompt": "what is 2 ?", "response": "5", "reward": 1.0}, line])
    with pytest.raises(ConfigError, match=rf"bad.jsonl:2: {expect}"):
        load_jsonl(path, vocab_size=100, tokenizer=lambda: tok)


def test_text_lines_without_a_tokenizer_name_model_hf(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"prompt": "a", "response": "b", "reward": 1.0}])
    with pytest.raises(ConfigError, match=r"t.jsonl:1: prompt: text lines need the run's tokenizer: set model.hf"):
        load_jsonl(path, vocab_size=100)


def test_token_ids_beyond_the_model_vocabulary_are_refused(hf_dir, tmp_path):
    tok = RunTokenizer.from_hf_dir(hf_dir)
    path = write(tmp_path / "v.jsonl", [{"prompt": "what is", "response": "brief.", "reward": 1.0}])
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        load_jsonl(path, vocab_size=10, tokenizer=lambda: tok)


def test_missing_template_and_tokenizer_are_clear(tmp_path, hf_dir):
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        RunTokenizer.from_hf_dir(tmp_path)
    tok = RunTokenizer.from_hf_dir(hf_dir)
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="has no chat template"):
        tok.chat([{"role": "assistant", "content": "5"}])
    assert isinstance(tok.prompt_response("what", "5")[0], np.ndarray)
