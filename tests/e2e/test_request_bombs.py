"""Requests that declare little and send much, against the real server (one process, and with
`--frontends 2`, where the parent decodes for every front-end), on both transports: each gets
INVALID_ARGUMENT with a short message naming the mismatch while a concurrent good call gets
its answer, and the server answers afterwards. What decoding them costs is counted in
tests/unit/test_decoding_cost.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request, parse_response
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.test_python_model import python_repository
from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60.0
MAX_MESSAGE = 64 << 20
# Entries of each bomb: every bomb is a message of 2 MiB or more (an HTTP/3 message between
# 1 and 1.5 MiB meets a separate flow-control fault).
BOMB_ENTRIES = 1 << 21
EMPTY = b"\0\0\0\0"
LONG_NAME = "n" * BOMB_ENTRIES
MESSAGE_LIMIT = 512  # characters: a refusal names the problem, it does not repeat the request


def text_request(shape: tuple[int, ...] = (1, 1)) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="upper")
    request.inputs.add(name="text", datatype="BYTES", shape=shape)
    return request


def raw_elements() -> pb.ModelInferRequest:
    request = text_request()
    request.raw_input_contents.append(EMPTY * BOMB_ENTRIES)
    return request


def typed_values() -> pb.ModelInferRequest:
    request = text_request()
    request.inputs[0].contents.bytes_contents.extend([b""] * BOMB_ENTRIES)
    return request


def rank() -> pb.ModelInferRequest:
    request = text_request((1,) * BOMB_ENTRIES)
    request.raw_input_contents.append(EMPTY)
    return request


def outputs() -> pb.ModelInferRequest:
    request = text_request()
    request.raw_input_contents.append(EMPTY)
    for _ in range(BOMB_ENTRIES // 8):
        request.outputs.add(name="upper")
    return request


def inputs() -> pb.ModelInferRequest:
    """Empty entries: 2 bytes each on the wire, a message object each once parsed."""
    request = text_request()
    request.raw_input_contents.append(EMPTY)
    for _ in range(BOMB_ENTRIES // 2):
        request.inputs.add()
    return request


def parameters() -> pb.ModelInferRequest:
    request = text_request()
    request.raw_input_contents.append(EMPTY)
    for key in range(BOMB_ENTRIES // 8):
        request.parameters[str(key)].bool_param = True
    return request


def input_name() -> pb.ModelInferRequest:
    request = text_request()
    request.inputs[0].name = LONG_NAME
    request.raw_input_contents.append(EMPTY)
    return request


def model_name() -> pb.ModelInferRequest:
    request = raw_elements()
    request.model_name = LONG_NAME
    return request


def model_version() -> pb.ModelInferRequest:
    request = raw_elements()
    request.model_version = "9" * BOMB_ENTRIES
    return request


def request_id() -> pb.ModelInferRequest:
    """A valid request but for its id, which every response would echo."""
    request = text_request()
    request.raw_input_contents.append(EMPTY)
    request.id = "i" * BOMB_ENTRIES
    return request


BOMBS: dict[str, tuple[Callable[[], pb.ModelInferRequest], tuple[str, ...]]] = {
    "raw BYTES elements": (
        raw_elements,
        ("input 'text': shape [1, 1] needs 1 BYTES elements", "holds more"),
    ),
    "typed BYTES values": (
        typed_values,
        (f"needs 1 values in contents.bytes_contents, got {BOMB_ENTRIES}",),
    ),
    "rank": (rank, ("more than 64 dimensions in an input's shape", "refused before parsing")),
    "requested outputs": (outputs, ("more than 1024 requested outputs", "refused before")),
    "inputs": (inputs, ("more than 1024 inputs", "refused before parsing")),
    "parameters": (parameters, ("more than 1024 parameters", "refused before parsing")),
    "input name": (input_name, ("has no input", f"({len(LONG_NAME)} characters)")),
    "model name": (model_name, ("is not a plain name", f"({len(LONG_NAME)} characters)")),
    "model version": (model_version, ("is not a version number", f"({BOMB_ENTRIES} characters)")),
    "request id": (
        request_id,
        (f"the request's id has {BOMB_ENTRIES} bytes, more than 256", "refused before parsing"),
    ),
}


def serving(root: Path, certs_dir: Path, frontends: int) -> Iterator[ServerProcess]:
    args = ["--frontends", str(frontends), "--certs-dir", str(certs_dir)]
    with running_server(python_repository(root / "models"), root / "server.log", args) as served:
        yield served


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(tmp_path_factory.mktemp("bombs"), certs_dir, 1)


@pytest.fixture(scope="module")
def frontends_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    yield from serving(tmp_path_factory.mktemp("bombs"), certs_dir, 2)


# Every bomb against one process; with --frontends 2, one per stage that refuses (before
# parsing, while validating), so the parent's decoding is shown to be the same.
CASES = [
    *(("server", bomb) for bomb in sorted(BOMBS)),
    *(("frontends_server", bomb) for bomb in ("inputs", "raw BYTES elements", "request id")),
]


def channel(server: ServerProcess, certs_dir: Path, transport: str) -> grpc.aio.Channel:
    if transport == "h2":
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
        ]
        return grpc.aio.insecure_channel(server.address, options=options)
    quic = QuicChannel(f"localhost:{server.port}", ca_file=str(certs_dir / "ca.pem"))
    return quic  # type: ignore[return-value]


async def refusal(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the bomb was accepted")


@pytest.mark.parametrize("transport", ["h2", "h3"])
@pytest.mark.parametrize(("where", "bomb"), CASES, ids=[f"{w}-{b}" for w, b in CASES])
async def test_bomb_is_refused_while_a_good_call_completes(
    request: pytest.FixtureRequest, certs_dir: Path, transport: str, where: str, bomb: str
) -> None:
    server: ServerProcess = request.getfixturevalue(where)
    make, expected = BOMBS[bomb]
    good = build_request("upper", {"text": np.array([[b"fine"]], dtype=np.object_)})
    async with channel(server, certs_dir, transport) as opened:
        stub = pb_grpc.GRPCInferenceServiceStub(opened)
        refused, answered, live = await asyncio.gather(
            refusal(stub.ModelInfer(make(), timeout=TIMEOUT_S)),
            stub.ModelInfer(good, timeout=TIMEOUT_S),
            stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT_S),
        )
        assert live.live
        assert parse_response(answered)["upper"].tolist() == [[b"FINE"]]
        details = refused.details() or ""
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT, details[:MESSAGE_LIMIT]
        for part in expected:
            assert part in details
        assert len(details) < MESSAGE_LIMIT
        after = await stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT_S)
        assert after.live


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_a_bomb_in_a_stream_gets_its_error_and_the_stream_goes_on(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    bomb = raw_elements()
    bomb.id = "bomb"
    good = build_request(
        "upper", {"text": np.array([[b"next"]], dtype=np.object_)}, request_id="good"
    )

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield bomb
        yield good

    async with channel(server, certs_dir, transport) as opened:
        stub = pb_grpc.GRPCInferenceServiceStub(opened)
        answers = {
            r.infer_response.id: r
            async for r in stub.ModelStreamInfer(requests(), timeout=TIMEOUT_S)
        }
    assert sorted(answers) == ["bomb", "good"]
    error = answers["bomb"].error_message
    assert error.startswith("INVALID_ARGUMENT: ") and "holds more" in error
    assert answers["good"].error_message == ""
    assert parse_response(answers["good"].infer_response)["upper"].tolist() == [[b"NEXT"]]


@pytest.mark.parametrize("transport", ["h2", "h3"])
@pytest.mark.parametrize("bomb", ["inputs", "request id"])
async def test_a_stream_message_over_the_wire_limits_ends_the_stream_invalid(
    server: ServerProcess, certs_dir: Path, transport: str, bomb: str
) -> None:
    """Refused before parsing, the message has no id to answer it under: the stream ends with
    INVALID_ARGUMENT, and the server goes on."""
    good = build_request(
        "upper", {"text": np.array([[b"first"]], dtype=np.object_)}, request_id="good"
    )

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield good
        yield BOMBS[bomb][0]()

    async with channel(server, certs_dir, transport) as opened:
        stub = pb_grpc.GRPCInferenceServiceStub(opened)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for _ in stub.ModelStreamInfer(requests(), timeout=TIMEOUT_S):
                pass
        assert ended.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert BOMBS[bomb][1][0] in (ended.value.details() or "")
        after = await stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT_S)
        assert after.live


async def test_a_flood_of_failures_quoting_huge_names_grows_the_log_by_kilobytes(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Each failing call names a 2 MiB model: its log line quotes a bounded part of the name,
    and the failure budget counts the bytes of the lines it lets through."""
    before = server.log_path.stat().st_size
    async with channel(server, certs_dir, "h2") as opened:
        stub = pb_grpc.GRPCInferenceServiceStub(opened)
        for _ in range(60):
            refused = await refusal(stub.ModelInfer(model_name(), timeout=TIMEOUT_S))
            assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
        await stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT_S)
    assert server.log_path.stat().st_size - before < 256 << 10
