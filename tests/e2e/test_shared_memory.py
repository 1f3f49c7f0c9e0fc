"""Triton's system shared-memory extension through the generated stubs on both transports: a
tensor in a registered region in and out, the caller's mistakes refused one by one while the
server goes on, `--shared-memory off`, and the `shared-memory` restricted-protocol category."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.inference.shared_memory import SHM_DIR
from tests.conformance.conftest import new_channel
from tests.reference import example_inputs, output_names, run_reference
from tests.servers import ServerProcess, model_repository, running_server

Array = np.ndarray[Any, Any]
OUTPUT = "probabilities"
ROWS, CLASSES = 3, 10


class Segment:
    """A POSIX shared-memory object, as a client on the server's host makes one."""

    def __init__(self, size: int) -> None:
        self.key = f"/pq-e2e-{secrets.token_hex(4)}"
        self.path = Path(SHM_DIR) / self.key.lstrip("/")
        self.path.write_bytes(bytes(size))

    def write(self, data: bytes, offset: int = 0) -> None:
        with self.path.open("r+b") as file:
            file.seek(offset)
            file.write(data)

    def read(self, size: int, offset: int = 0) -> bytes:
        return self.path.read_bytes()[offset : offset + size]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("shm")
    repository = model_repository(root / "models", ["mlp"])
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir)]) as process:
        yield process


@pytest.fixture(scope="module")
def two_frontends(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """Front-end processes pass calls (and their peers) to the parent, which holds the
    regions."""
    root = tmp_path_factory.mktemp("shm-frontends")
    repository = model_repository(root / "models", ["mlp"])
    args = ["--certs-dir", str(certs_dir), "--frontends", "2"]
    with running_server(repository, root / "log", args) as process:
        yield process


def failure(error: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str]:
    call = error.value
    assert isinstance(call, grpc.Call)
    return call.code(), call.details() or ""


@pytest.fixture
def segments() -> Iterator[list[Segment]]:
    made: list[Segment] = []
    yield made
    for segment in made:
        segment.path.unlink(missing_ok=True)


def shm_request(region_in: str, region_out: str, array: Array, offset: int = 0) -> Any:
    request = pb.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=array.shape)
    tensor.parameters["shared_memory_region"].string_param = region_in
    tensor.parameters["shared_memory_byte_size"].int64_param = array.nbytes
    if offset:
        tensor.parameters["shared_memory_offset"].int64_param = offset
    output = request.outputs.add(name=OUTPUT)
    output.parameters["shared_memory_region"].string_param = region_out
    output.parameters["shared_memory_byte_size"].int64_param = ROWS * CLASSES * 4
    return request


@pytest.mark.parametrize("processes", ["single", "two_frontends"])
@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_tensors_travel_in_shared_memory(
    request: pytest.FixtureRequest,
    certs_dir: Path,
    segments: list[Segment],
    transport: str,
    processes: str,
) -> None:
    server: ServerProcess = request.getfixturevalue(
        "server" if processes == "single" else processes
    )
    array = example_inputs("mlp", seed=11)["input"]
    inputs, outputs = Segment(64 + array.nbytes), Segment(ROWS * CLASSES * 4)
    segments += [inputs, outputs]
    inputs.write(array.tobytes(), offset=64)
    names = (f"in-{transport}", f"out-{transport}")
    async with new_channel(transport, server, certs_dir / "ca.pem") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name, segment in zip(names, (inputs, outputs), strict=True):
            size = segment.path.stat().st_size
            await stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(name=name, key=segment.key, byte_size=size)
            )
        status = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        response = await stub.ModelInfer(shm_request(*names, array, offset=64), timeout=30)
        for name in names:
            await stub.SystemSharedMemoryUnregister(
                pb.SystemSharedMemoryUnregisterRequest(name=name)
            )
    assert set(names) <= set(status.regions)
    assert list(response.outputs[0].shape) == [ROWS, CLASSES]
    assert list(response.raw_output_contents) == [b""]  # the output is in the region only
    served = np.frombuffer(outputs.read(ROWS * CLASSES * 4), np.float32).reshape(ROWS, CLASSES)
    expected = run_reference("mlp", {"input": array})[output_names("mlp")[0]]
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


def test_a_callers_mistakes_are_refused_and_nothing_else_changes(
    server: ServerProcess, segments: list[Segment]
) -> None:
    array = example_inputs("mlp", seed=12)["input"]
    segment = Segment(array.nbytes)
    segments.append(segment)
    segment.write(array.tobytes())
    stub = server.stub

    def code(method: Any, request: Any) -> grpc.StatusCode:
        try:
            method(request, timeout=30)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return exc.code()
        return grpc.StatusCode.OK

    def register(name: str, key: str, size: int, offset: int = 0) -> grpc.StatusCode:
        request = pb.SystemSharedMemoryRegisterRequest(
            name=name, key=key, byte_size=size, offset=offset
        )
        return code(stub.SystemSharedMemoryRegister, request)

    def infer(request: Any) -> grpc.StatusCode:
        return code(stub.ModelInfer, request)

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert register("m", "/../../etc/passwd", 8) == invalid
    assert register("m", "/no-such-object-anywhere", 8) == invalid
    assert register("m", segment.key, array.nbytes + 1) == invalid  # past the object's end
    assert register("m", segment.key, array.nbytes) == grpc.StatusCode.OK
    assert register("m", segment.key, 4) == grpc.StatusCode.ALREADY_EXISTS
    wrong_size = shm_request("m", "m", array)
    wrong_size.inputs[0].parameters["shared_memory_byte_size"].int64_param = 12
    assert infer(wrong_size) == invalid
    assert infer(shm_request("m", "m", array, offset=4)) == invalid  # past the region's end
    assert infer(shm_request("unknown", "m", array)) == invalid
    os.truncate(segment.path, 16)  # the client shrinks its object under the server
    assert infer(shm_request("m", "m", array)) == invalid
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="m"))
    # The server is fine: an ordinary request answers.
    answer = stub.ModelInfer(build_request("mlp", {"input": array}), timeout=30)
    assert list(answer.outputs[0].shape) == [ROWS, CLASSES]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """A server with shared memory off, and one whose shared-memory category is restricted."""
    root = tmp_path_factory.mktemp("shm-guarded")
    repository = model_repository(root / "models", ["mlp"])
    args = ["--no-h3"]
    with (
        running_server(repository, root / "off.log", [*args, "--shared-memory", "off"]) as off,
        running_server(
            repository,
            root / "restricted.log",
            [*args, "--restricted-protocol", "shared-memory:admin-key=let-me-in"],
        ) as restricted,
    ):
        yield {"off": off, "restricted": restricted}


def test_off_refuses_every_shared_memory_rpc(guarded: dict[str, ServerProcess]) -> None:
    stub = guarded["off"].stub
    with pytest.raises(grpc.RpcError) as refused:
        stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=10)
    code, details = failure(refused)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--shared-memory off" in details


def test_the_restricted_category_needs_its_header(guarded: dict[str, ServerProcess]) -> None:
    stub = guarded["restricted"].stub
    request = pb.SystemSharedMemoryStatusRequest()
    with pytest.raises(grpc.RpcError) as refused:
        stub.SystemSharedMemoryStatus(request, timeout=10)
    assert failure(refused)[0] == grpc.StatusCode.UNAUTHENTICATED
    header = [("triton-grpc-protocol-admin-key", "let-me-in")]
    assert stub.SystemSharedMemoryStatus(request, timeout=10, metadata=header).regions == {}
