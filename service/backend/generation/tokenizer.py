"""A character-level tokenizer: vocab.json is a JSON list of tokens, a token's index is its id.
Two ids are special: `<eos>` ends a generation (finish_reason `stop`) and `<unk>` stands for
any character the vocabulary lacks (and decodes to U+FFFD). Each token decodes to whole
characters, so every response of a stream is valid UTF-8 on its own."""

from __future__ import annotations

import json
from pathlib import Path

EOS, UNKNOWN = "<eos>", "<unk>"


class CharTokenizer:
    def __init__(self, vocab_file: Path) -> None:
        tokens = json.loads(vocab_file.read_text())
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{vocab_file} must hold a JSON list of strings")
        self.tokens: tuple[str, ...] = tuple(tokens)
        self.ids = {token: index for index, token in enumerate(self.tokens)}
        for special in (EOS, UNKNOWN):
            if special not in self.ids:
                raise ValueError(f"{vocab_file} has no {special} token")
        self.eos, self.unknown = self.ids[EOS], self.ids[UNKNOWN]

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(char, self.unknown) for char in text]

    def decode(self, token: int) -> str:
        """The text of one token: nothing for `<eos>`, U+FFFD for `<unk>`."""
        if token == self.eos:
            return ""
        return "\ufffd" if token == self.unknown else self.tokens[token]
