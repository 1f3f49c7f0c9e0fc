"""The generate example's char-level tokenizer (service/backend/generation/tokenizer.py) with
its shipped vocab.json."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.backend.generation.tokenizer import CharTokenizer

VOCAB = (
    Path(__file__).resolve().parents[2] / "examples" / "generate" / "generate" / "1" / "vocab.json"
)
PROPERTY = settings(max_examples=100, deadline=None, derandomize=True, database=None)


@PROPERTY
@given(st.text(st.characters(min_codepoint=32, max_codepoint=126) | st.just("\n")))
def test_printable_ascii_and_newlines_round_trip(text: str) -> None:
    tokenizer = CharTokenizer(VOCAB)
    tokens = tokenizer.encode(text)
    assert len(tokens) == len(text)
    assert "".join(tokenizer.decode(t) for t in tokens) == text
    assert tokenizer.eos not in tokens and tokenizer.unknown not in tokens


@PROPERTY
@given(st.text(st.characters(min_codepoint=127), min_size=1))
def test_any_other_character_is_unknown_and_decodes_to_the_replacement_character(
    text: str,
) -> None:
    tokenizer = CharTokenizer(VOCAB)
    assert tokenizer.encode(text) == [tokenizer.unknown] * len(text)
    assert tokenizer.decode(tokenizer.unknown) == "\ufffd"
    assert tokenizer.decode(tokenizer.eos) == ""


@pytest.mark.parametrize("content", ['{"a": 1}', '["<eos>", "a"]', '["<unk>", 3]'])
def test_a_vocabulary_without_its_special_tokens_or_not_a_list_is_refused(
    tmp_path: Path, content: str
) -> None:
    (tmp_path / "vocab.json").write_text(content)
    with pytest.raises(ValueError, match=r"vocab\.json"):
        CharTokenizer(tmp_path / "vocab.json")
