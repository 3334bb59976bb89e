"""`trainingrun score` input: validation naming file, line and field; packing of lines into forward passes."""

from __future__ import annotations

import json

import pytest

from trainingrun.modeling.score import ScoreError, _packs, read_token_lines


def test_valid_lines_are_read_in_order(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"tokens": [1, 2, 3]}\n\n{"tokens": [4]}\n')
    assert read_token_lines(p, vocab_size=10, seq_length=8) == [[1, 2, 3], [4]]


@pytest.mark.parametrize("line,expect", [
    ("not json", "not valid JSON"),
    ('{"tokens": []}', "tokens: must be a non-empty list"),
    ('{"tokens": [1, true]}', "tokens: must be a non-empty list"),
    ('{"tokens": [1, 10]}', r"tokens: ids must be in \[0, 10\)"),
    ('{"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]}', "tokens: 9 tokens exceed the model's 8 positions"),
    ('{"ids": [1]}', "tokens: must be a non-empty list"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, line, expect):
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"tokens": [1, 2]}) + "\n" + line + "\n")
    with pytest.raises(ScoreError, match=rf"in.jsonl:2: {expect}"):
        read_token_lines(p, vocab_size=10, seq_length=8)


def test_packs_respect_the_token_budget_and_keep_order():
    lines = [[0] * n for n in (3, 4, 2, 9, 1)]
    packs = _packs(lines, 8)
    assert packs == [[0, 1], [2], [3], [4]]
    assert [i for p in packs for i in p] == list(range(len(lines)))
    assert all(sum(len(lines[i]) for i in p) <= 8 or len(p) == 1 for p in packs)
