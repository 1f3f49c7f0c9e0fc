"""Drive the server with Triton's own Python client (tritonclient[grpc]), unmodified.

Run as a separate process (``python tests/interop/tritonclient_check.py --url ...``): tritonclient's
generated protos and ours both define ``inference.ServerLiveRequest``, so they cannot share one
descriptor pool. This file therefore imports nothing from ``protos``,
``service``, ``clients`` or ``tests``; it only needs numpy and tritonclient.

Input file (npz), keys:
  ``infer.<model>.<input>``        one ModelInfer per model, with every input of that model
  ``stream.<request_id>.<input>``  ModelStreamInfer requests for mlp, sent in file order

Output file (npz), keys:
  ``infer.<model>.<output>``       outputs of the ModelInfer calls
  ``stream.<request_id>.<output>`` outputs of the successful stream responses
  ``summary``                      a JSON document (as a 0-d unicode array), described in main()

Every check is recorded rather than raised, so one interop failure does not hide the others; the
calling test decides what must hold.
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

Array = np.ndarray[Any, Any]
STREAM_MODEL = "mlp"
TIMEOUT_S = 120.0


def _tensor_metadata(tensors: Any) -> list[dict[str, Any]]:
    """Plain data from tritonclient's parsed TensorMetadata (int64 shapes stay ints, not JSON
    strings as MessageToJson would give)."""
    return [
        {"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]}
        for t in tensors
    ]


def _group(arrays: dict[str, Array], kind: str) -> dict[str, dict[str, Array]]:
    """``kind.key.input`` entries grouped by key, keeping file order (the stream's send order)."""
    grouped: dict[str, dict[str, Array]] = {}
    for name, array in arrays.items():
        prefix, _, rest = name.partition(".")
        if prefix != kind:
            continue
        key, _, tensor = rest.rpartition(".")
        grouped.setdefault(key, {})[tensor] = array
    return grouped


def _infer_inputs(arrays: dict[str, Array]) -> list[Any]:
    """InferInputs filled the way tritonclient users do: set_data_from_numpy (raw bytes)."""
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _record(summary: dict[str, Any], section: str, check: Callable[[], Any]) -> None:
    """Run one check, storing its result or the error it raised under ``section``."""
    try:
        summary[section] = check()
    except Exception as error:
        summary.setdefault("errors", {})[section] = f"{type(error).__name__}: {error}"
        traceback.print_exc()


def _error_dict(error: InferenceServerException) -> dict[str, Any]:
    return {"status": error.status(), "message": error.message()}


def run(url: str, arrays: dict[str, Array]) -> tuple[dict[str, Any], dict[str, Array]]:
    """All the checks; returns the JSON summary and the output tensors."""
    summary: dict[str, Any] = {}
    outputs: dict[str, Array] = {}
    infer_inputs = _group(arrays, "infer")
    models = list(infer_inputs)
    client = grpcclient.InferenceServerClient(url=url)
    try:
        _record(summary, "live", lambda: bool(client.is_server_live(client_timeout=TIMEOUT_S)))
        _record(summary, "ready", lambda: bool(client.is_server_ready(client_timeout=TIMEOUT_S)))

        def server_metadata() -> dict[str, Any]:
            metadata = client.get_server_metadata(client_timeout=TIMEOUT_S)
            return {"name": metadata.name, "version": metadata.version}

        _record(summary, "server_metadata", server_metadata)

        def model_metadata(model: str) -> dict[str, Any]:
            metadata = client.get_model_metadata(model, client_timeout=TIMEOUT_S)
            return {
                "name": metadata.name,
                "versions": list(metadata.versions),
                "platform": metadata.platform,
                "inputs": _tensor_metadata(metadata.inputs),
                "outputs": _tensor_metadata(metadata.outputs),
                "ready": bool(client.is_model_ready(model, client_timeout=TIMEOUT_S)),
            }

        def model_config(model: str) -> dict[str, Any]:
            config = client.get_model_config(model, client_timeout=TIMEOUT_S).config
            return {
                "name": config.name,
                "platform": config.platform,
                "max_batch_size": config.max_batch_size,
                "inputs": [[t.name, t.data_type, list(t.dims)] for t in config.input],
                "outputs": [[t.name, t.data_type, list(t.dims)] for t in config.output],
            }

        for model in models:
            _record(summary, f"metadata.{model}", functools.partial(model_metadata, model))
            _record(summary, f"config.{model}", functools.partial(model_config, model))

        def index() -> list[list[str]]:
            answer = client.get_model_repository_index(client_timeout=TIMEOUT_S)
            return sorted([m.name, m.version, m.state] for m in answer.models)

        _record(summary, "repository_index", index)

        def infer(model: str) -> dict[str, Any]:
            names = [t["name"] for t in summary[f"metadata.{model}"]["outputs"]]
            result = client.infer(
                model,
                _infer_inputs(infer_inputs[model]),
                outputs=[grpcclient.InferRequestedOutput(name) for name in names],
                request_id=f"infer-{model}",
                client_timeout=TIMEOUT_S,
            )
            response = result.get_response()
            for name in names:
                outputs[f"infer.{model}.{name}"] = result.as_numpy(name)
            return {
                "id": response.id,
                "model_name": response.model_name,
                "model_version": response.model_version,
                "outputs": _tensor_metadata(response.outputs),
            }

        for model in models:
            _record(summary, f"infer.{model}", functools.partial(infer, model))

        def unknown_model() -> dict[str, Any]:
            try:
                client.get_model_metadata("no_such_model", client_timeout=TIMEOUT_S)
            except InferenceServerException as error:
                return _error_dict(error)
            return {"status": None, "message": "no error raised"}

        _record(summary, "unknown_model", unknown_model)
        _record(summary, "stream", lambda: stream(client, _group(arrays, "stream"), outputs))
    finally:
        client.close()
    return summary, outputs


def stream(
    client: Any, requests: dict[str, dict[str, Array]], outputs: dict[str, Array]
) -> dict[str, Any]:
    """All requests go out before any answer is read, so several are in flight at once.
    tritonclient's callback gets no request id with an error (error_message carries none), so
    errors are recorded in arrival order next to the ids of the successful responses."""
    received: queue.Queue[tuple[Any, Any]] = queue.Queue()
    output = client.get_model_metadata(STREAM_MODEL, client_timeout=TIMEOUT_S).outputs[0].name
    client.start_stream(
        callback=lambda result, error: received.put((result, error)), stream_timeout=TIMEOUT_S
    )
    try:
        for request_id, arrays in requests.items():
            client.async_stream_infer(
                STREAM_MODEL,
                _infer_inputs(arrays),
                outputs=[grpcclient.InferRequestedOutput(output)],
                request_id=request_id,
            )
    finally:
        # Half-closes the request stream and blocks until the server has answered everything.
        client.stop_stream()
    arrivals: list[dict[str, Any]] = []
    while not received.empty():
        result, error = received.get_nowait()
        if error is not None:
            arrivals.append({"error": _error_dict(error)})
            continue
        response = result.get_response()
        outputs[f"stream.{response.id}.output0"] = result.as_numpy(output)
        arrivals.append({"id": response.id, "model_name": response.model_name})
    return {"sent": list(requests), "arrivals": arrivals}


def main(argv: list[str] | None = None) -> int:
    """Summary keys: live, ready, server_metadata, metadata.<m>, config.<m>, repository_index,
    infer.<m>, unknown_model, stream, and errors (section -> exception text) if any check
    raised."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", required=True, help="HOST:PORT of the gRPC endpoint")
    parser.add_argument("--inputs", required=True, type=Path, help="npz of input tensors")
    parser.add_argument("--out", required=True, type=Path, help="npz to write")
    args = parser.parse_args(argv)
    with np.load(args.inputs) as data:
        arrays = {name: data[name] for name in data.files}
    summary, outputs = run(args.url, arrays)
    np.savez(args.out, summary=np.array(json.dumps(summary)), **outputs)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
