"""Logits of `text_classifier` to the most likely of its four classes and that class's softmax
probability."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

LABELS = (b"negative", b"neutral", b"positive", b"mixed")


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probabilities = shifted / shifted.sum(axis=1, keepdims=True)
            best = probabilities.argmax(axis=1)
            label = np.array([LABELS[i] for i in best], dtype=np.object_).reshape(-1, 1)
            score = probabilities[np.arange(len(best)), best].astype(np.float32).reshape(-1, 1)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("label", label),
                        pb_utils.Tensor("score", score),
                    ]
                )
            )
        return responses
