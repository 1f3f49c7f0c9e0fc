"""Compressed requests (gzip, deflate) as grpcio accepts them over HTTP/2, on both transports:
inflated within --max-message-bytes, a decompression bomb refused with RESOURCE_EXHAUSTED, and
every answer telling the client which encodings it may use (grpc-accept-encoding)."""

from __future__ import annotations

import asyncio
import gzip
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc.aio import AioRpcError

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import MAX_MESSAGE
from tests.servers import ServerProcess
from transport.grpc import headers as wire

UNARY = "/paddlequic.v1.Testing/Unary"
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
}
H2_COMPRESSION = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}
# A client allowed to send more than the server accepts: the server's limit is under test.
BIG_SENDER = [("grpc.max_send_message_length", 2 * MAX_MESSAGE)]
ANSWER_TIMEOUT_S = 30.0


async def h3_unary(
    server: ServerProcess, ca_file: Path, encoding: str, message: bytes, compressed: bool
) -> tuple[dict[bytes, bytes], list[bytes]]:
    """A raw HTTP/3 Unary call whose request carries `grpc-encoding: encoding` and one message
    (flagged compressed or not): the response's first header block (with the status for a
    Trailers-Only answer, otherwise trailers merged in) and the response messages."""
    async with QuicChannel(f"localhost:{server.port}", ca_file=str(ca_file)) as channel:
        stream = (await channel.connection()).open_stream()
        stream.send_headers(
            [
                *wire.request_headers(channel.authority, UNARY, None),
                (b"grpc-encoding", encoding.encode()),
            ]
        )
        prefix = struct.pack(">BI", int(compressed), len(message))
        await stream.send_data(prefix + message, end=True)
        block = dict(await asyncio.wait_for(stream.wait_headers(), ANSWER_TIMEOUT_S))
        messages: list[bytes] = []
        if b"grpc-status" not in block:
            while (
                data := await asyncio.wait_for(stream.read_message(), ANSWER_TIMEOUT_S)
            ) is not None:
                messages.append(data)
            assert stream.trailers is not None
            block.update(dict(stream.trailers))
        return block, messages


@pytest.mark.parametrize("encoding", sorted(COMPRESSORS))
async def test_compressed_requests_are_accepted_on_http2(
    conformance_server: ServerProcess, encoding: str
) -> None:
    async with grpc.aio.insecure_channel(conformance_server.address) as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(payload=b"squeeze me " * 1000)
        reply = await stub.Unary(request, compression=H2_COMPRESSION[encoding], timeout=30)
        assert reply.payload == request.payload


@pytest.mark.parametrize("encoding", sorted(COMPRESSORS))
@pytest.mark.parametrize("compressed", [True, False], ids=["compressed", "flag-0"])
async def test_compressed_requests_are_accepted_on_http3(
    conformance_server: ServerProcess, ca_file: Path, encoding: str, compressed: bool
) -> None:
    """A message of a compressing call may still go uncompressed (flag 0), as gRPC allows."""
    payload = b"squeeze me " * 1000
    message = pb.EchoRequest(payload=payload).SerializeToString()
    body = COMPRESSORS[encoding](message) if compressed else message
    block, messages = await h3_unary(conformance_server, ca_file, encoding, body, compressed)
    assert block[b"grpc-status"] == b"0"
    assert block[b"grpc-accept-encoding"] == b"identity,deflate,gzip"
    assert [pb.EchoResponse.FromString(m).payload for m in messages] == [payload]


async def test_an_encoding_not_accepted_is_refused_naming_those_that_are(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    block, _ = await h3_unary(conformance_server, ca_file, "snappy", b"\x00" * 8, True)
    assert block[b"grpc-status"] == b"12"
    assert block[b"grpc-accept-encoding"] == b"identity,deflate,gzip"


def bomb(size: int) -> bytes:
    """A gzip stream of `size` zero bytes, built a MiB at a time (some 1000:1)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    chunks = [compressor.compress(zeros) for _ in range(size >> 20)]
    return b"".join(
        [*chunks, compressor.compress(bytes(size & ((1 << 20) - 1))), compressor.flush()]
    )


async def test_a_decompression_bomb_is_resource_exhausted_on_http3(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    """Some 64 KiB on the wire that would inflate past --max-message-bytes (64 MiB)."""
    data = bomb(MAX_MESSAGE + (1 << 20))
    assert len(data) < MAX_MESSAGE >> 8
    block, _ = await h3_unary(conformance_server, ca_file, "gzip", data, True)
    assert block[b"grpc-status"] == b"8"
    assert b"inflates past the limit" in block[b"grpc-message"]


async def test_a_decompression_bomb_is_resource_exhausted_on_http2(
    conformance_server: ServerProcess,
) -> None:
    """grpcio compresses the 65 MiB message itself: some 64 KiB travel."""
    request = pb.EchoRequest(payload=bytes(MAX_MESSAGE + (1 << 20)))
    async with grpc.aio.insecure_channel(conformance_server.address, options=BIG_SENDER) as channel:
        stub = pb_grpc.TestingStub(channel)
        with pytest.raises(AioRpcError) as refused:
            await stub.Unary(request, compression=grpc.Compression.Gzip, timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
