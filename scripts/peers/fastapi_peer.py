"""A KServe v2 REST server for `make bench-http`, as a team would write it with FastAPI on
uvicorn: `GET /v2/health/ready` and `POST /v2/models/{model}/infer` with JSON tensors, the
request validated by pydantic models, each call running the model's Paddle predictor (the one
paddlequic's CPU workers make, same config: bench_common.worker_predictor) in the handler, on
the event loop: one call at a time, no batching, no other process (a Paddle predictor is not
safe to share between threads, so no thread pool either). uvicorn with its defaults: uvloop
and httptools where installed, no access log.

    python -m scripts.peers.fastapi_peer --port PORT MODEL_DIR...
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException
from google.protobuf import text_format
from pydantic import BaseModel

from oip.datatypes import BY_NAME, from_numpy
from protos.inference import model_config_pb2 as mc
from scripts.bench_common import worker_predictor


class Tensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


class InferRequest(BaseModel):
    id: str | None = None
    inputs: list[Tensor]


class Predictor:
    """One model's predictor: the request's one input in, every output under the config's
    names out."""

    def __init__(self, directory: Path) -> None:
        config = text_format.Parse((directory / "config.pbtxt").read_text(), mc.ModelConfig())
        self.name = config.name
        self.model = worker_predictor(directory, config)
        self.fetches = tuple(o.name for o in self.model.outputs)
        self.names = [o.name for o in config.output]

    def answer(self, request: InferRequest) -> dict[str, Any]:
        (tensor,) = request.inputs
        dtype = BY_NAME[tensor.datatype].numpy
        rows = np.asarray(tensor.data, dtype).reshape(tensor.shape)
        outputs, _ = self.model.run({tensor.name: rows}, self.fetches)
        return {
            "model_name": self.name,
            "id": request.id or "",
            "outputs": [
                {
                    "name": name,
                    "datatype": from_numpy(outputs[fetch].dtype).name,
                    "shape": list(outputs[fetch].shape),
                    "data": outputs[fetch].ravel().tolist(),
                }
                for name, fetch in zip(self.names, self.fetches, strict=True)
            ],
        }


def application(directories: list[Path]) -> FastAPI:
    predictors = {p.name: p for p in map(Predictor, directories)}
    app = FastAPI()

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str, request: InferRequest) -> dict[str, Any]:
        predictor = predictors.get(model)
        if predictor is None:
            raise HTTPException(404, f"no model {model!r}")
        return predictor.answer(request)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("models", nargs="+", type=Path, help="model directories")
    args = parser.parse_args()
    uvicorn.run(
        application(args.models),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
