"""Two KServe v2 GRPCInferenceService servers for `make bench-peers`, each a grpc.aio server on
127.0.0.1 in a process of its own, answering ServerLive, ServerReady and ModelInfer:

- `predictor`: what a team writes in an afternoon. Each ModelInfer runs the model's Paddle
  predictor (the one paddlequic's CPU workers make, same config: bench_common.worker_predictor)
  in the handler, on the event loop: one call at a time, no batching, no other process.
- `canned`: answers every ModelInfer with a response of the model's output shape for one row,
  built once, running nothing: what the gRPC transport itself costs, the ceiling.

grpc.aio rather than grpcio's thread-pool server: on `mlp` at concurrency 32 the aio one
answered more calls per second (docs/benchmarks.md, "make bench-peers").

    python -m scripts.peers.grpc_peer --port PORT --kind predictor MODEL_DIR...
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import text_format

from oip.datatypes import BY_CONFIG_TYPE, BY_NAME, from_numpy
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.inference import model_config_pb2 as mc
from scripts.bench_common import worker_predictor

Answer = Callable[[pb.ModelInferRequest], pb.ModelInferResponse]


def add_output(response: pb.ModelInferResponse, name: str, array: np.ndarray[Any, Any]) -> None:
    response.outputs.add(name=name, datatype=from_numpy(array.dtype).name, shape=array.shape)
    response.raw_output_contents.append(array.tobytes())


def predictor_answer(directory: Path, config: mc.ModelConfig) -> Answer:
    """Runs the predictor on the request's one input; outputs under the config's names."""
    model = worker_predictor(directory, config)
    fetches = tuple(o.name for o in model.outputs)
    names = [o.name for o in config.output]

    def answer(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        (tensor,) = request.inputs
        dtype = BY_NAME[tensor.datatype].numpy
        rows = np.frombuffer(request.raw_input_contents[0], dtype).reshape(tuple(tensor.shape))
        outputs, _ = model.run({tensor.name: rows}, fetches)
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, fetch in zip(names, fetches, strict=True):
            add_output(response, name, outputs[fetch])
        return response

    return answer


def canned_answer(directory: Path, config: mc.ModelConfig) -> Answer:
    """The same response every time: zeros of each output's shape for one row."""
    response = pb.ModelInferResponse(model_name=config.name)
    for output in config.output:
        dtype = BY_CONFIG_TYPE[output.data_type].numpy
        add_output(response, output.name, np.zeros((1, *output.dims), dtype))
    return lambda request: response


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        answer = self.answers.get(request.model_name)
        if answer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.model_name!r}")
        return answer(request)


@dataclass(frozen=True)
class Peer:
    port: int
    kind: str
    models: Sequence[Path]


async def serve(peer: Peer) -> None:
    build = predictor_answer if peer.kind == "predictor" else canned_answer
    answers = {}
    for directory in peer.models:
        text = (directory / "config.pbtxt").read_text()
        config = text_format.Parse(text, mc.ModelConfig())
        answers[config.name] = build(directory, config)
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(answers), server)
    server.add_insecure_port(f"127.0.0.1:{peer.port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kind", choices=("predictor", "canned"), required=True)
    parser.add_argument("models", nargs="+", type=Path, help="model directories")
    args = parser.parse_args()
    asyncio.run(serve(Peer(args.port, args.kind, args.models)))


if __name__ == "__main__":
    main()
