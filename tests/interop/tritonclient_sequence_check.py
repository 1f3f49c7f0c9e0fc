"""Drive sequences of a sequence-batched model with Triton's own Python client (tritonclient).

Run as a separate process: tritonclient's generated protos and ours cannot share a descriptor
pool, so this file imports nothing from ``protos``, ``service`` or ``tests``. Over HTTP/2 it
is tritonclient as it is: `InferenceServerClient.infer(..., sequence_id=, sequence_start=,
sequence_end=)` and its stream (`async_stream_infer` with the same arguments). tritonclient
has no HTTP/3, so over HTTP/3 its own request messages, generated stub and `InferResult` run
on this project's QuicChannel (which imports no protos either).

Input (npz): ``<s>.<i>`` the i-th chunk of sequence s. Every sequence runs interleaved with
the others, round robin, each request waiting for its answer. Output (npz): ``<way>.<s>.<i>``
the scores of that request, for way in h2, h2-stream (h2 only) and h3; ``summary``: a JSON
document: ``ids`` (the sequence ids used) and ``errors`` (way -> exception text).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from clients.quic_channel import QuicChannel

Array = np.ndarray[Any, Any]
MODEL = "kws"
TIMEOUT_S = 120.0
# Sequence ids of both kinds tritonclient sends: integers (int64_param) and strings.
FIRST_ID = 7_000_000_000


def _input(chunk: Array) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("features", list(chunk.shape), "FP32")
    tensor.set_data_from_numpy(chunk)
    return tensor


def _order(chunks: dict[int, list[Array]]) -> list[tuple[int, int]]:
    length = len(next(iter(chunks.values())))
    return [(s, i) for i in range(length) for s in sorted(chunks)]


def _ids(way: str, count: int) -> list[int | str]:
    """Odd sequences get string ids, even ones integers; distinct per way."""
    offset = {"h2": 0, "h2-stream": 100, "h3": 200}[way]
    return [f"{way}-{s}" if s % 2 else FIRST_ID + offset + s for s in range(count)]


def run_h2(address: str, chunks: dict[int, list[Array]]) -> dict[str, Array]:
    client = grpcclient.InferenceServerClient(address)
    ids, length, out = _ids("h2", len(chunks)), len(chunks[0]), {}
    for s, i in _order(chunks):
        result = client.infer(
            MODEL,
            [_input(chunks[s][i])],
            sequence_id=ids[s],
            sequence_start=i == 0,
            sequence_end=i == length - 1,
            client_timeout=TIMEOUT_S,
        )
        out[f"h2.{s}.{i}"] = result.as_numpy("scores")
    client.close()
    return out


def run_h2_stream(address: str, chunks: dict[int, list[Array]]) -> dict[str, Array]:
    """Every request written to one stream at once; answers correlate by request id."""
    client = grpcclient.InferenceServerClient(address)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    ids, length = _ids("h2-stream", len(chunks)), len(chunks[0])
    order = _order(chunks)
    for s, i in order:
        client.async_stream_infer(
            MODEL,
            [_input(chunks[s][i])],
            request_id=f"{s}.{i}",
            sequence_id=ids[s],
            sequence_start=i == 0,
            sequence_end=i == length - 1,
        )
    out = {}
    for _ in order:
        result, error = answers.get(timeout=TIMEOUT_S)
        if error is not None:
            raise error
        out[f"h2-stream.{result.get_response().id}"] = result.as_numpy("scores")
    client.stop_stream()
    client.close()
    return out


def run_h3(url: str, ca_file: str, chunks: dict[int, list[Array]]) -> dict[str, Array]:
    async def run() -> dict[str, Array]:
        ids, length, out = _ids("h3", len(chunks)), len(chunks[0]), {}
        async with QuicChannel(url, ca_file=ca_file) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for s, i in _order(chunks):
                request = _get_inference_request(
                    model_name=MODEL,
                    inputs=[_input(chunks[s][i])],
                    model_version="",
                    request_id="",
                    outputs=None,
                    sequence_id=ids[s],
                    sequence_start=i == 0,
                    sequence_end=i == length - 1,
                    priority=0,
                    timeout=None,
                    parameters=None,
                )
                response = await stub.ModelInfer(request, timeout=TIMEOUT_S)
                out[f"h3.{s}.{i}"] = grpcclient.InferResult(response).as_numpy("scores")
        return out

    return asyncio.run(run())


def _recorded(
    errors: dict[str, str], way: str, run: Callable[[], dict[str, Array]]
) -> dict[str, Array]:
    try:
        return run()
    except Exception:
        errors[way] = traceback.format_exc()
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--address", required=True, help="HOST:PORT of the HTTP/2 endpoint")
    parser.add_argument("--h3", required=True, help="HOST:PORT of the HTTP/3 endpoint")
    parser.add_argument("--ca-file", required=True, help="the CA the HTTP/3 server's cert is from")
    parser.add_argument("--inputs", required=True, type=Path, help="npz of chunks")
    parser.add_argument("--out", required=True, type=Path, help="npz to write")
    args = parser.parse_args(argv)
    chunks: dict[int, list[Array]] = {}
    with np.load(args.inputs) as data:
        for name in sorted(data.files, key=lambda n: tuple(int(p) for p in n.split("."))):
            s, _ = (int(p) for p in name.split("."))
            chunks.setdefault(s, []).append(data[name])
    errors: dict[str, str] = {}
    outputs = {
        **_recorded(errors, "h2", lambda: run_h2(args.address, chunks)),
        **_recorded(errors, "h2-stream", lambda: run_h2_stream(args.address, chunks)),
        **_recorded(errors, "h3", lambda: run_h3(args.h3, args.ca_file, chunks)),
    }
    summary = {"ids": {way: _ids(way, len(chunks)) for way in ("h2", "h2-stream", "h3")}}
    summary["errors"] = errors  # type: ignore[assignment]
    np.savez(args.out, summary=np.array(json.dumps(summary)), **outputs)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
