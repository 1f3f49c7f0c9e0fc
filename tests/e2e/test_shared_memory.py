"""Triton's system shared-memory extension through the generated stubs on both transports: a
tensor in a registered region in and out, the caller's mistakes refused one by one while the
server goes on, `--shared-memory off`, the `shared-memory` restricted-protocol category on
every request that names a region, objects used only as far as the calling user could open
them and regions known only to the user that registered them (callers started as uid 65534),
local callers of a dual-stack listener, BYTES tensors in regions and their bounds, and the
CUDA shared-memory RPCs answered as Triton without a GPU answers them."""

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
from clients.quic_channel import QuicChannel
from oip.bytes_tensor import serialize_bytes
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.inference.shared_memory import SHM_DIR
from tests.call_as import run_as
from tests.conformance.conftest import H2_OPTIONS, new_channel
from tests.e2e.test_python_model import python_repository
from tests.reference import example_inputs, output_names, run_reference
from tests.servers import ServerProcess, model_repository, paused, running_server

Array = np.ndarray[Any, Any]
OUTPUT = "probabilities"
ROWS, CLASSES = 3, 10
NOBODY = 65534  # the calling user of the tests that are not the server's (root's)
ROOT_ONLY = 0o600


class Segment:
    """A POSIX shared-memory object, as a client on the server's host makes one."""

    def __init__(self, size: int, mode: int = 0o600) -> None:
        self.key = f"/pq-e2e-{secrets.token_hex(4)}"
        self.path = Path(SHM_DIR) / self.key.lstrip("/")
        self.path.write_bytes(bytes(size))
        self.path.chmod(mode)

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


async def register_whole(stub: Any, names: tuple[str, ...], segments: tuple[Segment, ...]) -> None:
    """Each segment registered whole under its name."""
    for name, segment in zip(names, segments, strict=True):
        size = segment.path.stat().st_size
        await stub.SystemSharedMemoryRegister(
            pb.SystemSharedMemoryRegisterRequest(name=name, key=segment.key, byte_size=size)
        )


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
        await register_whole(stub, names, (inputs, outputs))
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


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_a_frontend_serves_tensors_in_shared_memory_with_the_parent_stopped(
    two_frontends: ServerProcess, certs_dir: Path, segments: list[Segment], transport: str
) -> None:
    """The parent gives each front-end a copy of each region it registers: a front-end reads
    the input from its region and writes the output into its own, for ModelInfer and for a
    stream's requests, the parent held still by SIGSTOP; once unregistered, the regions are
    no process's."""
    server = two_frontends
    inputs, outputs = Segment(4096), Segment(ROWS * CLASSES * 4)
    segments += [inputs, outputs]
    names = (f"here-in-{transport}", f"here-out-{transport}")
    expected = []
    async with new_channel(transport, server, certs_dir / "ca.pem") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await register_whole(stub, names, (inputs, outputs))
        for seed in range(3):  # this front-end's queues attached
            plain = example_inputs("mlp", seed=seed)
            await stub.ModelInfer(build_request("mlp", plain), timeout=30)
        with paused(server.process.pid):
            for seed in range(3):
                array = example_inputs("mlp", seed=40 + seed)["input"]
                inputs.write(array.tobytes())
                response = await stub.ModelInfer(shm_request(*names, array), timeout=30)
                assert list(response.raw_output_contents) == [b""]
                served = np.frombuffer(outputs.read(ROWS * CLASSES * 4), np.float32)
                expected.append((served.reshape(ROWS, CLASSES).copy(), array))
            # A stream's requests too, each answered before the next is sent (one region).
            stream = stub.ModelStreamInfer(timeout=30)
            for seed in range(2):
                array = example_inputs("mlp", seed=50 + seed)["input"]
                inputs.write(array.tobytes())
                await stream.write(shm_request(*names, array))
                answer = await stream.read()
                assert not answer.error_message, answer.error_message
                assert list(answer.infer_response.raw_output_contents) == [b""]
                served = np.frombuffer(outputs.read(ROWS * CLASSES * 4), np.float32)
                expected.append((served.reshape(ROWS, CLASSES).copy(), array))
            await stream.done_writing()
        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.ModelInfer(shm_request(*names, array), timeout=30)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"'{names[0]}' is not registered" in (gone.value.details() or "")
    for served, array in expected:
        reference = run_reference("mlp", {"input": array})[output_names("mlp")[0]]
        np.testing.assert_allclose(served, reference, rtol=1e-4, atol=1e-5)


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
    assert infer(shm_request("unknown", "m", array)) == grpc.StatusCode.NOT_FOUND
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
            [
                *args,
                "--shared-memory",
                "any",
                "--restricted-protocol",
                "shared-memory:admin-key=let-me-in",
            ],
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


def test_the_restricted_category_covers_requests_naming_a_region(
    guarded: dict[str, ServerProcess], segments: list[Segment]
) -> None:
    """A caller without the header names no region, its own included."""
    stub = guarded["restricted"].stub
    header = [("triton-grpc-protocol-admin-key", "let-me-in")]
    array = example_inputs("mlp", seed=13)["input"]
    segment = Segment(array.nbytes + ROWS * CLASSES * 4)
    segments.append(segment)
    segment.write(array.tobytes())
    register = pb.SystemSharedMemoryRegisterRequest(
        name="r", key=segment.key, byte_size=segment.path.stat().st_size
    )
    stub.SystemSharedMemoryRegister(register, timeout=10, metadata=header)
    request = shm_request("r", "r", array)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=30)
    code, details = failure(refused)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "triton-grpc-protocol-admin-key" in details and "shared-memory regions" in details
    assert segment.read(array.nbytes) == array.tobytes()  # nothing read over it
    assert list(stub.ModelInfer(request, timeout=30, metadata=header).outputs[0].shape) == [
        ROWS,
        CLASSES,
    ]
    stub.SystemSharedMemoryUnregister(
        pb.SystemSharedMemoryUnregisterRequest(name="r"), timeout=10, metadata=header
    )


def target_of(transport: str, server: ServerProcess) -> str:
    return server.address if transport == "h2" else f"127.0.0.1:{server.port}"


@pytest.mark.parametrize("processes", ["single", "two_frontends"])
@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_a_caller_uses_an_object_only_as_far_as_it_could_open_it(
    request: pytest.FixtureRequest,
    certs_dir: Path,
    segments: list[Segment],
    transport: str,
    processes: str,
) -> None:
    """uid 65534 cannot open root's 0600 object, so it cannot register it; it can read root's
    0644 object, so it may register it and read from it, but no output goes there."""
    server: ServerProcess = request.getfixturevalue(
        "server" if processes == "single" else processes
    )
    array = example_inputs("mlp", seed=14)["input"]
    secret, readable = Segment(4096, ROOT_ONLY), Segment(4096, 0o644)
    segments += [secret, readable]
    secret.write(b"root's secret")
    readable.write(array.tobytes())

    def register(name: str, segment: Segment) -> tuple[str, Any]:
        return "SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
            name=name, key=segment.key, byte_size=4096
        )

    into_message = shm_request("shared", "shared", array)
    del into_message.outputs[:]
    calls = [
        register("stolen", secret),
        register("shared", readable),
        ("ModelInfer", shm_request("shared", "shared", array)),  # the output back into it
        ("ModelInfer", into_message),
        ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="")),
    ]
    target = target_of(transport, server)
    stolen, shared, write_back, read, unregister = run_as(
        NOBODY, transport, target, calls, certs_dir / "ca.pem"
    )
    assert stolen[0] == "PERMISSION_DENIED"
    assert "uid 65534, another user, may not read" in stolen[1] and "mode 0600" in stolen[1]
    assert shared == ("OK", "")
    assert write_back[0] == "PERMISSION_DENIED" and "takes no output" in write_back[1]
    assert read == ("OK", "")  # reading is what it may do
    assert unregister == ("OK", "")
    assert secret.read(13) == b"root's secret"
    assert readable.read(array.nbytes) == array.tobytes()


@pytest.mark.parametrize("processes", ["single", "two_frontends"])
@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_a_region_is_known_only_to_the_uid_that_registered_it(
    request: pytest.FixtureRequest,
    certs_dir: Path,
    segments: list[Segment],
    transport: str,
    processes: str,
) -> None:
    server: ServerProcess = request.getfixturevalue(
        "server" if processes == "single" else processes
    )
    array = example_inputs("mlp", seed=15)["input"]
    mine = Segment(4096, 0o666)  # anyone could open it, yet the region stays root's
    segments.append(mine)
    mine.write(array.tobytes())
    name = f"mine-{transport}"
    server.stub.SystemSharedMemoryRegister(
        pb.SystemSharedMemoryRegisterRequest(name=name, key=mine.key, byte_size=4096), timeout=10
    )
    try:
        answers = run_as(
            NOBODY,
            transport,
            target_of(transport, server),
            [
                ("ModelInfer", shm_request(name, name, array)),
                ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name=name)),
                ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name="unknown")),
                ("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="")),
            ],
            certs_dir / "ca.pem",
        )
        everyone = server.stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
    finally:
        server.stub.SystemSharedMemoryUnregister(
            pb.SystemSharedMemoryUnregisterRequest(name=name), timeout=10
        )
    unknown = ("NOT_FOUND", "shared-memory region 'unknown' is not registered")
    assert [(code, details.replace(name, "unknown")) for code, details in answers[:3]] == [
        unknown
    ] * 3
    assert answers[3] == ("OK", "")  # unregistering all of its own: none
    assert name in everyone.regions  # still root's
    assert mine.read(array.nbytes + 4) == array.tobytes() + bytes(4)  # nothing written


@pytest.fixture(scope="module")
def dual_stack(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("shm-dual-stack")
    repository = model_repository(root / "models", ["mlp"])
    args = ["--certs-dir", str(certs_dir), "--host", "::"]
    with running_server(repository, root / "log", args) as process:
        yield process


@pytest.mark.parametrize("address", ["::1", "127.0.0.1"])
@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_local_serves_both_loopbacks_on_a_dual_stack_listener(
    dual_stack: ServerProcess,
    certs_dir: Path,
    segments: list[Segment],
    transport: str,
    address: str,
) -> None:
    """The server sees 127.0.0.1 as ::ffff:127.0.0.1 on a `::` listener."""
    segment = Segment(64)
    segments.append(segment)
    target = f"[{address}]:{dual_stack.port}" if ":" in address else f"{address}:{dual_stack.port}"
    channel: Any = (
        grpc.aio.insecure_channel(target, options=H2_OPTIONS)
        if transport == "h2"
        else QuicChannel(target, ca_file=str(certs_dir / "ca.pem"), server_name="localhost")
    )
    async with channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.SystemSharedMemoryRegister(
            pb.SystemSharedMemoryRegisterRequest(name="r", key=segment.key, byte_size=64),
            timeout=10,
        )
        status = await stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="r"))
    assert list(status.regions) == ["r"]


STRING_LIMIT = 1 << 20  # the strings server's --max-message-bytes


@pytest.fixture(scope="module")
def strings(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    """A server with the `upper` Python model (BYTES in; BYTES and INT32 out), whose messages
    and shared-memory tensors are bounded at 1 MiB."""
    root = tmp_path_factory.mktemp("shm-strings")
    repository = python_repository(root / "models")
    args = ["--certs-dir", str(certs_dir), "--max-message-bytes", str(STRING_LIMIT)]
    with running_server(repository, root / "log", args) as process:
        yield process


def text_request(
    region: str, byte_size: int, rows: int, outputs: dict[str, tuple[str, int]]
) -> Any:
    """`upper`'s BYTES input [rows, 1] in `region`; each output in the region named for it."""
    request = pb.ModelInferRequest(model_name="upper")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[rows, 1])
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = byte_size
    for name, (out_region, size) in outputs.items():
        output = request.outputs.add(name=name)
        output.parameters["shared_memory_region"].string_param = out_region
        output.parameters["shared_memory_byte_size"].int64_param = size
    return request


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_bytes_tensors_travel_in_shared_memory(
    strings: ServerProcess, certs_dir: Path, segments: list[Segment], transport: str
) -> None:
    """Each element a 4-byte little-endian length and its bytes, as tritonclient's
    serialize_byte_tensor writes them: read from the caller's region, written into its
    regions, the message carrying neither."""
    words = [b"paddle", b"", "h\u00e9".encode(), b"quic"]
    serialized = serialize_bytes(words)
    text, upper, length = (
        Segment(len(serialized)),
        Segment(len(serialized)),
        Segment(4 * len(words)),
    )
    segments += [text, upper, length]
    text.write(serialized)
    names = {f"{part}-{transport}": part for part in ("text", "upper", "length")}
    regions = dict(zip(names, (text, upper, length), strict=True))
    async with new_channel(transport, strings, certs_dir / "ca.pem") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name, segment in regions.items():
            await stub.SystemSharedMemoryRegister(
                pb.SystemSharedMemoryRegisterRequest(
                    name=name, key=segment.key, byte_size=segment.path.stat().st_size
                )
            )
        request = text_request(
            f"text-{transport}",
            len(serialized),
            len(words),
            {
                "upper": (f"upper-{transport}", len(serialized)),
                "length": (f"length-{transport}", 4 * len(words)),
            },
        )
        response = await stub.ModelInfer(request, timeout=60)
        await stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
    assert list(response.raw_output_contents) == [b"", b""]
    assert [list(o.shape) for o in response.outputs] == [[len(words), 1]] * 2
    expected = [w.decode().upper().encode() for w in words]
    assert upper.read(len(serialized)) == serialize_bytes(expected)
    assert np.frombuffer(length.read(16), np.int32).tolist() == [6, 0, 2, 4]


def test_bytes_in_shared_memory_keep_the_regions_bounds(
    strings: ServerProcess, segments: list[Segment]
) -> None:
    """A BYTES input's byte size is bounded by --max-message-bytes and by its region before
    anything is read; its elements must be what its shape declares; an output that does not
    fit its region is refused; the server goes on."""
    stub = strings.stub
    big = Segment(2 * STRING_LIMIT)
    segments.append(big)
    big.write(serialize_bytes([b"x" * 8]))
    stub.SystemSharedMemoryRegister(
        pb.SystemSharedMemoryRegisterRequest(name="big", key=big.key, byte_size=2 * STRING_LIMIT),
        timeout=10,
    )
    small = Segment(8)
    segments.append(small)
    stub.SystemSharedMemoryRegister(
        pb.SystemSharedMemoryRegisterRequest(name="small", key=small.key, byte_size=8),
        timeout=10,
    )

    def refusal(request: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=60)
        return failure(refused)

    over_limit = refusal(text_request("big", STRING_LIMIT + 1, 1, {}))
    assert over_limit[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-bytes" in over_limit[1]
    past_region = refusal(text_request("small", 12, 1, {}))
    assert past_region[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "lies outside shared-memory region 'small'" in past_region[1]
    two_declared = refusal(text_request("big", 12, 2, {}))  # one element in the bytes
    assert two_declared[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'text'" in two_declared[1]
    too_small = refusal(text_request("big", 12, 1, {"upper": ("small", 8)}))
    assert too_small[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "output 'upper' has 12 bytes; its region offers 8" in too_small[1]
    assert small.read(8) == bytes(8)  # nothing written
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=10)
    text = np.array([[b"still"]], dtype=np.object_)
    answer = stub.ModelInfer(build_request("upper", {"text": text}), timeout=60)
    assert answer.raw_output_contents[0] == serialize_bytes([b"STILL"])


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_cuda_shared_memory_answers_as_triton_without_a_gpu(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """Status and unregister succeed on nothing (Triton's clients unregister every CUDA
    region first); registering fails, naming the region."""
    async with new_channel(transport, server, certs_dir / "ca.pem") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest())
        await stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="gpu"))
        status = await stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest())
        with pytest.raises(grpc.aio.AioRpcError) as named:
            await stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(name="gpu"))
        with pytest.raises(grpc.aio.AioRpcError) as registered:
            await stub.CudaSharedMemoryRegister(
                pb.CudaSharedMemoryRegisterRequest(
                    name="gpu", raw_handle=bytes(64), device_id=0, byte_size=1024
                )
            )
    assert status.regions == {}
    assert named.value.code() == grpc.StatusCode.NOT_FOUND
    assert (named.value.details() or "").startswith(
        "Unable to find cuda shared memory region: 'gpu'"
    )
    assert registered.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (registered.value.details() or "").startswith(
        "failed to register CUDA shared memory region: 'gpu', GPUs not supported"
    )


def test_off_refuses_the_cuda_shared_memory_rpcs_too(guarded: dict[str, ServerProcess]) -> None:
    stub = guarded["off"].stub
    with pytest.raises(grpc.RpcError) as refused:
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=10)
    code, details = failure(refused)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--shared-memory off" in details
