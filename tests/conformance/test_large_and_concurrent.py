"""Large messages and many concurrent streams on one connection."""

from __future__ import annotations

import asyncio
import os

import grpc

from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import EOF, ChannelFactory, transport_stats
from tests.servers import ServerProcess

LARGE = 32 << 20
CONCURRENT = 256


async def test_32_mib_unary_round_trip(make_channel: ChannelFactory) -> None:
    payload = os.urandom(LARGE)

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        response = await stub.Unary(pb.EchoRequest(payload=payload), timeout=60)
        assert len(response.payload) == LARGE
        assert response.payload == payload


async def test_messages_larger_than_the_flow_control_windows(make_channel: ChannelFactory) -> None:
    """Streams of 2 MiB messages, twice the per-stream windows, both ways."""
    chunk = os.urandom(2 << 20)

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        requests = [pb.EchoRequest(payload=chunk) for _ in range(3)]
        response = await stub.ClientStream(iter(requests), timeout=60)
        assert (response.messages, response.total_bytes) == (3, 3 * len(chunk))
        call = stub.BidiStream(iter(requests), timeout=60)
        assert [r.payload == chunk async for r in call] == [True] * 3


async def test_256_concurrent_calls_on_one_channel(
    make_channel: ChannelFactory, transport: str, conformance_server: ServerProcess
) -> None:
    before = await transport_stats(conformance_server)
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        responses = await asyncio.gather(
            *(
                stub.Unary(pb.EchoRequest(payload=i.to_bytes(2, "big")), timeout=60)
                for i in range(CONCURRENT)
            )
        )
        assert [int.from_bytes(r.payload, "big") for r in responses] == list(range(CONCURRENT))
        after = await transport_stats(conformance_server)
    if transport == "h3":
        assert after.h3_connections == before.h3_connections + 1
        assert after.h3_calls == before.h3_calls + CONCURRENT
    else:
        assert after.h3_connections == before.h3_connections


async def test_256_concurrent_streams_on_one_channel(make_channel: ChannelFactory) -> None:
    """All streams open at once: each bidi call waits for its first response before any
    call finishes, so the server holds 256 streams of one connection simultaneously."""

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        calls = [stub.BidiStream(timeout=60) for _ in range(CONCURRENT)]

        async def first(i: int) -> int:
            await calls[i].write(pb.EchoRequest(payload=i.to_bytes(2, "big")))
            response = await calls[i].read()
            return int.from_bytes(response.payload, "big")

        assert await asyncio.gather(*(first(i) for i in range(CONCURRENT))) == list(
            range(CONCURRENT)
        )

        async def finish(i: int) -> grpc.StatusCode:
            await calls[i].done_writing()
            assert await calls[i].read() == EOF
            code: grpc.StatusCode = await calls[i].code()
            return code

        codes = await asyncio.gather(*(finish(i) for i in range(CONCURRENT)))
        assert set(codes) == {grpc.StatusCode.OK}
