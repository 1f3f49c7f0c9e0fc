"""Text to token ids for `text_classifier`: lower-cased words looked up in vocab.txt (one word a
line; its line number is its id; 0 pads, 1 is any unknown word), cut or padded to 32 ids.

Every text gets exactly 32 ids, so its ids (and the classifier's answer) never depend on the
other texts it happens to be batched with."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

LENGTH = 32
PAD, UNKNOWN = 0, 1
WORD = re.compile(r"[a-z0-9']+")


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        words = (Path(__file__).with_name("vocab.txt")).read_text().split()
        self.ids = {word: index for index, word in enumerate(words)}

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
            ids = np.full((len(texts), LENGTH), PAD, dtype=np.int64)
            for row, text in enumerate(texts):
                tokens = [self.ids.get(w, UNKNOWN) for w in WORD.findall(_text(text).lower())]
                ids[row, : min(len(tokens), LENGTH)] = tokens[:LENGTH]
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("token_ids", ids)])
            )
        return responses


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
