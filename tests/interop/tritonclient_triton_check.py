"""What Triton's example clients do and compare, with tritonclient itself, against a server
started as they expect one (`--server-name triton`, explicit model control): run as a separate
process (tritonclient's protos and ours cannot share one descriptor pool), so this file imports
nothing from ``protos``, ``service`` or ``tests``.

Writes JSON to ``--out``: for each step, what the server answered (a value, or the message of
the error tritonclient raised; `stopped by`: the error that ended the step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils as utils
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


def error_of(call: Callable[[], Any]) -> str | None:
    """The message of the error a tritonclient call raised (None: it succeeded)."""
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.message())
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return str(exc.details())
    return None


def step(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A step's answers, or the error that stopped it (each test then fails on its own)."""
    try:
        return run()
    except (InferenceServerException, grpc.RpcError) as exc:
        return {"stopped by": str(exc)}


def explicit_int_request(version: str = "") -> Any:
    """The request of Triton's grpc_explicit_int_content_client.py: INT32 typed contents."""
    request = service_pb2.ModelInferRequest(model_name="simple", model_version=version)
    for name, values in (("INPUT0", list(range(16))), ("INPUT1", [1] * 16)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents[:] = values
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


def texts(client: grpcclient.InferenceServerClient, url: str) -> dict[str, Any]:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
    answered = stub.ModelInfer(explicit_int_request(), timeout=60)
    sums = np.frombuffer(answered.raw_output_contents[0], np.int32).tolist()
    both = explicit_int_request()
    both.raw_input_contents.extend([np.arange(8, dtype=np.int32).tobytes()])
    return {
        "typed_sums": sums,
        "unknown_model": error_of(lambda: client.get_model_metadata("wrong_model_name")),
        "bad_version": error_of(
            lambda: stub.ModelInfer(explicit_int_request("wrong_specification"), timeout=60)
        ),
        "contents_beside_raw": error_of(lambda: stub.ModelInfer(both, timeout=60)),
        "load_unknown": error_of(lambda: client.load_model("wrong_model_name")),
    }


def cuda(client: grpcclient.InferenceServerClient) -> dict[str, Any]:
    """What Triton's shared-memory examples do first, and a registration, which a server
    without CUDA refuses."""
    return {
        "unregister": error_of(client.unregister_cuda_shared_memory),
        "status": client.get_cuda_shared_memory_status(as_json=True),
        "register": error_of(
            lambda: client.register_cuda_shared_memory("gpu_region", b"\0" * 64, 0, 1024)
        ),
        "status_after": client.get_cuda_shared_memory_status(as_json=True),
    }


def bytes_in_shared_memory(client: grpcclient.InferenceServerClient) -> dict[str, Any]:
    """simple_grpc_shm_string_client.py's steps on the `upper` model: a BYTES input and a
    BYTES and an INT32 output, all in system shared memory."""
    words = np.array([[b"paddle"], [b"quic"], [b""], ["h\u00e9".encode()]], dtype=np.object_)
    serialized = utils.serialize_byte_tensor(words)
    in_size = utils.serialized_byte_size(serialized)
    upper_size = in_size  # upper-casing keeps each element's length here
    length_size = words.size * 4
    pid = os.getpid()
    regions = {
        "text_data": (f"/pq_text_{pid}", in_size),
        "upper_data": (f"/pq_upper_{pid}", upper_size),
        "length_data": (f"/pq_length_{pid}", length_size),
    }
    handles = {
        name: shm.create_shared_memory_region(name, key, size)
        for name, (key, size) in regions.items()
    }
    try:
        shm.set_shared_memory_region(handles["text_data"], [serialized])
        for name, (key, size) in regions.items():
            client.register_system_shared_memory(name, key, size)
        inputs = [grpcclient.InferInput("text", list(words.shape), "BYTES")]
        inputs[0].set_shared_memory("text_data", in_size)
        outputs = [
            grpcclient.InferRequestedOutput("upper"),
            grpcclient.InferRequestedOutput("length"),
        ]
        outputs[0].set_shared_memory("upper_data", upper_size)
        outputs[1].set_shared_memory("length_data", length_size)
        result = client.infer("upper", inputs, outputs=outputs)
        upper = result.get_output("upper")
        length = result.get_output("length")
        served_upper = shm.get_contents_as_numpy(
            handles["upper_data"], utils.triton_to_np_dtype(upper.datatype), upper.shape
        )
        served_length = shm.get_contents_as_numpy(
            handles["length_data"], utils.triton_to_np_dtype(length.datatype), length.shape
        )
        raw = result.get_response().raw_output_contents
        client.unregister_system_shared_memory()
        return {
            "upper": [v.decode() for v in served_upper.reshape(-1)],
            "length": served_length.reshape(-1).tolist(),
            "raw_lengths": [len(r) for r in raw],
            "left": client.get_system_shared_memory_status(as_json=True),
        }
    finally:
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    client = grpcclient.InferenceServerClient(args.url)
    try:
        index = client.get_model_repository_index(as_json=True)
        metadata = client.get_server_metadata(as_json=True)
        summary = {
            "index": index.get("models", []),
            "server_metadata": metadata,
            "texts": step(lambda: texts(client, args.url)),
            "cuda": step(lambda: cuda(client)),
            "bytes_shm": step(lambda: bytes_in_shared_memory(client)),
        }
    finally:
        client.close()
    args.out.write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
