"""BLS: `mlp` only for the rows that need it. A row whose L2 norm is below the config's
`min_norm` (a silent or empty input) is answered here with uniform probabilities; the other rows
go to `mlp` in one BLS call, through mlp's own batcher and instances. An ensemble runs every
step for every request; it cannot skip one."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]

CLASSES = 10


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.min_norm = float(parameters.get("min_norm", {}).get("string_value", "1.0"))

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._answer(request) for request in requests]

    def _answer(self, request: Any) -> Any:
        rows = pb_utils.get_input_tensor_by_name(request, "input").as_numpy()
        routed = np.linalg.norm(rows, axis=1) >= self.min_norm
        probabilities = np.full((len(rows), CLASSES), 1.0 / CLASSES, dtype=np.float32)
        if routed.any():
            call = pb_utils.InferenceRequest(
                model_name="mlp",
                requested_output_names=["probabilities"],
                inputs=[pb_utils.Tensor("input", np.ascontiguousarray(rows[routed]))],
            )
            response = call.exec()
            if response.has_error():
                return pb_utils.InferenceResponse(error=response.error())
            answered = pb_utils.get_output_tensor_by_name(response, "probabilities")
            probabilities[routed] = answered.as_numpy()
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("probabilities", probabilities),
                pb_utils.Tensor("routed", routed.reshape(-1, 1)),
            ]
        )
