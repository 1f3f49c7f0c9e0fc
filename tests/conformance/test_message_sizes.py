"""Messages of every size complete, both ways, on both transports, however they are framed:
sizes swept across the HTTP/3 stream and connection windows and the credit thresholds."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import ChannelFactory, new_channel
from tests.framed_h3 import (
    ALL_BOUNDARIES,
    CONNECTION_WINDOW,
    STREAM_BOUNDARIES,
    STREAM_WINDOW,
    framed_call,
    near,
)
from tests.servers import ServerProcess
from transport.grpc.framing import encode_message

CALL_TIMEOUT_S = 60.0
UNARY = "/paddlequic.v1.Testing/Unary"
CLIENT_STREAM = "/paddlequic.v1.Testing/ClientStream"
SWEEP = settings(max_examples=8, deadline=None, derandomize=True, database=None)


def payload(size: int) -> bytes:
    return os.urandom(size)


@pytest.mark.parametrize("transport", ["h2", "h3"])
@SWEEP
@given(size=near(ALL_BOUNDARIES))
@example(size=int(1.2 * (1 << 20)))
@example(size=int(1.4 * (1 << 20)))
def test_unary_echo_of_any_size(
    conformance_server: ServerProcess, ca_file: Path, transport: str, size: int
) -> None:
    """The request and its echo are the same size: both directions cross the boundary."""

    async def call() -> None:
        sent = payload(size)
        async with new_channel(transport, conformance_server, ca_file) as channel:
            stub = pb_grpc.TestingStub(channel)
            response = await stub.Unary(pb.EchoRequest(payload=sent), timeout=CALL_TIMEOUT_S)
            assert response.payload == sent

    asyncio.run(call())  # each example on an event loop (and channel) of its own


@pytest.mark.parametrize("transport", ["h2", "h3"])
@settings(SWEEP, max_examples=6)
@given(sizes=st.lists(near(STREAM_BOUNDARIES), min_size=2, max_size=3))
@example(sizes=[300_000, 900_000])  # each below the window, the second one never earned credit
def test_bidi_stream_of_mixed_sizes(
    conformance_server: ServerProcess, ca_file: Path, transport: str, sizes: list[int]
) -> None:
    """A stream whose messages straddle different boundaries, echoed one by one: the credit
    a message earns depends on what the messages before it consumed."""

    async def call() -> None:
        sent = [payload(size) for size in sizes]
        async with new_channel(transport, conformance_server, ca_file) as channel:
            stub = pb_grpc.TestingStub(channel)
            stream = stub.BidiStream(timeout=CALL_TIMEOUT_S)
            for message in sent:
                await stream.write(pb.EchoRequest(payload=message))
                assert (await stream.read()).payload == message
            await stream.done_writing()
            assert await stream.code() == grpc.StatusCode.OK

    asyncio.run(call())


@SWEEP
@given(
    sizes=st.lists(near(STREAM_BOUNDARIES), min_size=1, max_size=2),
    head=st.integers(1, 9),  # the first DATA frame ends inside the prefix, or just after
    chunk=st.sampled_from([1000, 4096, 16384, 65536]),
)
@example(sizes=[2 << 20], head=5, chunk=64 << 10)  # the reported 2 MiB in 33 frames
@example(sizes=[int(1.2 * (1 << 20))], head=3, chunk=16384)
@example(sizes=[CONNECTION_WINDOW], head=2, chunk=64 << 10)  # past the connection window
def test_request_in_many_data_frames(
    conformance_server: ServerProcess, ca_file: Path, sizes: list[int], head: int, chunk: int
) -> None:
    """HTTP/3 only (the framing is HTTP/3's): a client stream's messages in DATA frames of
    `chunk` bytes, as libcurl sends a body, the first splitting the 5-byte prefix."""
    messages = [pb.EchoRequest(payload=payload(size)).SerializeToString() for size in sizes]
    body = b"".join(map(encode_message, messages))
    answer = asyncio.run(
        framed_call(
            "127.0.0.1", conformance_server.port, str(ca_file), CLIENT_STREAM, body, head, chunk
        )
    )
    assert (answer.status, answer.message) == (grpc.StatusCode.OK, "")
    [response] = [pb.EchoResponse.FromString(r) for r in answer.responses]
    assert (response.messages, response.total_bytes) == (len(sizes), sum(sizes))
    assert answer.frames_sent == 1 + -(-(len(body) - head) // chunk)


# Concurrent calls whose partial messages together fill the connection window: aioquic's
# sender serves its streams in turn, so no message would complete without promotion.
CROWDS = [(20, STREAM_WINDOW * 9 // 10), (16, STREAM_WINDOW * 6 // 5)]


@pytest.mark.parametrize(("calls", "size"), CROWDS)
async def test_concurrent_uploads_past_the_connection_window(
    make_channel: ChannelFactory, calls: int, size: int
) -> None:
    assert calls * size > CONNECTION_WINDOW + size
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(payload=payload(size))
        responses = await asyncio.gather(
            *(stub.ClientStream(iter([request]), timeout=CALL_TIMEOUT_S) for _ in range(calls))
        )
        assert [(r.messages, r.total_bytes) for r in responses] == [(1, size)] * calls


async def test_concurrent_downloads_past_the_connection_window(
    make_channel: ChannelFactory,
) -> None:
    calls, size = CROWDS[1]
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(response_count=1, response_size=size)

        async def download() -> list[int]:
            call = stub.ServerStream(request, timeout=CALL_TIMEOUT_S)
            return [len(r.payload) async for r in call]

        assert await asyncio.gather(*(download() for _ in range(calls))) == [[size]] * calls
