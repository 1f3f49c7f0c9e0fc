"""Limits that bound what a peer can make the server hold, on both transports: an oversized
message and a metadata bomb are refused with RESOURCE_EXHAUSTED at once, the call does not
run, and the connection goes on serving."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest
from grpc.aio import AioRpcError

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import MAX_MESSAGE, ChannelFactory, transport_stats
from tests.servers import ServerProcess

MAX_METADATA = 16 << 10  # the server's default --max-metadata-bytes
# A client allowed to send more than the server accepts: the server's limit is under test.
BIG_SENDER = [("grpc.max_send_message_length", 2 * MAX_MESSAGE)]


async def executions(stub: pb_grpc.TestingStub, token: str) -> int:
    response = await stub.Executions(pb.EchoRequest(token=token), timeout=10)
    return int(response.messages)


async def test_oversized_message_is_refused_with_resource_exhausted(
    conformance_server: ServerProcess, transport: str, make_channel: ChannelFactory
) -> None:
    """HTTP/3 answers as soon as the 5-byte prefix announces too much (the deadline is far
    away: a transport that waits for it fails the code check)."""

    token = uuid.uuid4().hex
    channel = (
        grpc.aio.insecure_channel(conformance_server.address, options=BIG_SENDER)
        if transport == "h2"
        else make_channel()
    )
    async with channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(token=token, payload=b"x" * (MAX_MESSAGE + 1))
        with pytest.raises(AioRpcError) as refused:
            await stub.Unary(request, timeout=120)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await executions(stub, token) == 0
        reply = await stub.Unary(pb.EchoRequest(payload=b"after"), timeout=30)
        assert reply.payload == b"after"


async def test_metadata_bomb_is_refused_and_the_call_does_not_run(
    conformance_server: ServerProcess, transport: str, make_channel: ChannelFactory
) -> None:
    token = uuid.uuid4().hex
    bomb = [(f"x-bomb-{i}", "b" * 4096) for i in range(8)]  # 32 KiB
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        with pytest.raises(AioRpcError) as refused:
            await stub.Unary(pb.EchoRequest(token=token), metadata=bomb, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await executions(stub, token) == 0
        # Just under the limit still works, on the same connection.
        fits = [("x-fits", "f" * (MAX_METADATA // 2))]
        reply = await stub.Unary(pb.EchoRequest(payload=b"ok"), metadata=fits, timeout=30)
        assert reply.payload == b"ok"


def request_block(authority: str, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":authority", authority.encode()),
        (b":path", b"/paddlequic.v1.Testing/Unary"),
        (b"content-type", b"application/grpc"),
        *extra,
    ]


@pytest.mark.parametrize(
    ("data", "end", "status", "words"),
    [
        # Only the prefix of a 100 MiB message, and the stream left open: the answer must not
        # wait for more (on main it never came).
        (b"\x00" + (100 << 20).to_bytes(4, "big"), False, b"8", b"exceeds the limit"),
        (b"\x01\x00\x00\x00\x02ab", False, b"12", b"compressed"),
        (b"\x00\x00\x00\x00\x09abc", True, b"13", b"stream ended inside a message"),
    ],
    ids=["oversized-prefix", "compressed", "truncated"],
)
async def test_h3_decode_errors_are_answered_with_their_status(
    conformance_server: ServerProcess,
    ca_file: Path,
    data: bytes,
    end: bool,
    status: bytes,
    words: bytes,
) -> None:
    """HTTP/3 only, written by hand: the server answers a malformed request stream with the
    status that names the problem, while the client's side of the stream may still be open."""

    channel = QuicChannel(f"localhost:{conformance_server.port}", ca_file=str(ca_file))
    async with channel:
        stream = (await channel.connection()).open_stream()
        stream.send_headers(request_block(channel.authority))
        await stream.send_data(data, end=end)
        block = await asyncio.wait_for(stream.wait_headers(), 30)
        assert dict(block)[b"grpc-status"] == status
        assert words in dict(block)[b"grpc-message"]


async def test_h3_server_refuses_a_metadata_bomb_from_a_client_that_ignores_its_settings(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    """HTTP/3 only: QuicChannel itself refuses to send metadata over the server's
    SETTINGS_MAX_FIELD_SECTION_SIZE, so the stream is written by hand here. The server
    answers with a status that names the limit."""

    before = (await transport_stats(conformance_server)).h3_refusals["metadata"]
    channel = QuicChannel(f"localhost:{conformance_server.port}", ca_file=str(ca_file))
    async with channel:
        stream = (await channel.connection()).open_stream()
        bomb = [(b"x-bomb-%d" % i, b"b" * 4096) for i in range(8)]
        stream.send_headers(request_block(channel.authority, *bomb), end=True)
        block = await asyncio.wait_for(stream.wait_headers(), 30)
        assert (b"grpc-status", b"8") in block
        assert b"SETTINGS_MAX_FIELD_SECTION_SIZE" in dict(block)[b"grpc-message"]
    after = (await transport_stats(conformance_server)).h3_refusals["metadata"]
    assert after == before + 1
