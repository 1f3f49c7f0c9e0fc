"""`mlp`'s shapes and architecture (256 -> 128 -> ReLU -> 10 -> softmax) in numpy, with random
weights drawn at load from a fixed seed: `make bench-scale ARGS="--model mlp_numpy"` on a host
without Paddle (the device machine). It names no BLS call, so it takes its instance queues
(python_code.py) and both of bench-scale's paths serve it as they serve mlp."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        rng = np.random.default_rng(0)
        self.w1 = rng.standard_normal((256, 128), np.float32) / 16
        self.w2 = rng.standard_normal((128, 10), np.float32) / 11

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "input").as_numpy()
            logits = np.maximum(rows @ self.w1, 0) @ self.w2
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probabilities = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("probabilities", probabilities)]
                )
            )
        return responses
