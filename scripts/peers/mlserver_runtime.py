"""An MLServer custom runtime for `make bench-peers`: the model's Paddle predictor, the one
paddlequic's CPU workers make (same config: bench_common.worker_predictor), run on each request
MLServer hands it (one call, or one adaptive batch), its rows padded to the model's batch
bucket as our workers pad them: the predictor keeps kernels for the buckets' shapes only.

It runs in `.venv-mlserver`, MLServer's own environment, with this checkout on PYTHONPATH;
model-settings.json names it as `scripts.peers.mlserver_runtime.PaddleRuntime`, with the model's
directory as `parameters.uri`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from google.protobuf import text_format
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from protos.inference import model_config_pb2 as mc
from scripts.bench_common import worker_predictor
from service.model.shapes import shape_buckets


class PaddleRuntime(MLModel):  # type: ignore[misc]  # mlserver is not installed for mypy
    async def load(self) -> bool:
        directory = Path(self.settings.parameters.uri)
        text = (directory / "config.pbtxt").read_text()
        config = text_format.Parse(text, mc.ModelConfig())
        self.model = worker_predictor(directory, config)
        self.shapes = shape_buckets(config)
        self.fetches = tuple(o.name for o in self.model.outputs)
        self.names = [o.name for o in config.output]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        (tensor,) = payload.inputs
        rows = NumpyCodec.decode_input(tensor)
        count = len(rows)
        padding = np.zeros((self.shapes.batch_rows(count) - count, *rows.shape[1:]), rows.dtype)
        outputs, _ = self.model.run({tensor.name: np.concatenate([rows, padding])}, self.fetches)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(name, outputs[fetch][:count])
                for name, fetch in zip(self.names, self.fetches, strict=True)
            ],
        )
