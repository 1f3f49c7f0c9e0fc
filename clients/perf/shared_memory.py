"""perf_analyzer's `--shared-memory system`: the inputs written once into a POSIX shared-memory
object and every request naming them by region (Triton's system shared-memory extension), each
output written by the server into a region of its own of `--output-shared-memory-size` bytes.
As perf_analyzer does, all the concurrent requests share these regions (the outputs overwrite
each other: they are measured, not read). The regions are registered before the run and
unregistered, and the objects removed, after it, whatever happened."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clients.tensors import Parameter, build_request, set_parameter
from oip.datatypes import from_numpy
from protos.inference import grpc_service_pb2 as pb

SHM_DIR = Path("/dev/shm")


@contextlib.asynccontextmanager
async def placed_request(
    stub: Any,
    metadata: Sequence[tuple[str, str]],
    model: str,
    version: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    outputs: Sequence[str],
    output_bytes: int,
    parameters: Mapping[str, Parameter] | None = None,
) -> AsyncIterator[bytes]:
    """The serialized request whose tensors lie in regions registered through `stub` (with
    `metadata` on each call), while the context lasts."""
    if output_bytes < 1:
        raise ValueError("--output-shared-memory-size must be at least 1 byte")
    contents = build_request(model, inputs).raw_input_contents  # as the message would carry them
    prefix = f"pq-perf-{os.getpid()}-{secrets.token_hex(4)}"
    objects = {
        f"{prefix}-in": b"".join(contents),
        f"{prefix}-out": bytes(output_bytes * len(outputs)),
    }
    registered: list[str] = []
    try:
        for name, data in objects.items():
            path = SHM_DIR / name
            path.write_bytes(data or b"\0")  # an object of no bytes cannot be registered
            path.chmod(0o600)
            await stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(
                    name=name, key="/" + name, byte_size=max(len(data), 1)
                ),
                metadata=metadata,
            )
            registered.append(name)
        request = pb.ModelInferRequest(model_name=model, model_version=version)
        for key, value in (parameters or {}).items():
            set_parameter(request.parameters[key], value)
        offset = 0
        for (name, array), data in zip(inputs.items(), contents, strict=True):
            datatype = from_numpy(array.dtype).name
            tensor = request.inputs.add(name=name, datatype=datatype, shape=array.shape)
            _place(tensor.parameters, f"{prefix}-in", len(data), offset)
            offset += len(data)
        for index, name in enumerate(outputs):
            output = request.outputs.add(name=name)
            _place(output.parameters, f"{prefix}-out", output_bytes, index * output_bytes)
        yield request.SerializeToString()
    finally:
        for name in registered:
            with contextlib.suppress(Exception):  # the server may be gone: the objects still go
                await stub.SystemSharedMemoryUnregister(
                    pb.SystemSharedMemoryUnregisterRequest(name=name), metadata=metadata
                )
        for name in objects:
            (SHM_DIR / name).unlink(missing_ok=True)


def _place(parameters: Any, region: str, byte_size: int, offset: int) -> None:
    parameters["shared_memory_region"].string_param = region
    parameters["shared_memory_byte_size"].int64_param = byte_size
    if offset:
        parameters["shared_memory_offset"].int64_param = offset
