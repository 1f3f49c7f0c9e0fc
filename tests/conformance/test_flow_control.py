"""Send backpressure of the HTTP/3 transport against a reader that does not keep up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import conformance_server_process, eventually, transport_stats
from tests.servers import ServerProcess
from transport.h3.protocol import SEND_HIGH_WATER

COUNT = 256
SIZE = 64 << 10  # 16 MiB in all: 8 times the receive window plus the send high-water mark
# A message as it sits in the send buffer: protobuf field overheads, gRPC and HTTP/3 framing.
MESSAGE_ON_WIRE = SIZE + 64
SLACK = 4096


@pytest.fixture(scope="module")
def quiet_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """A server of its own: h3_peak_send_buffered is the peak over the server's life, and
    other tests send 32 MiB messages (one message may exceed the high-water mark)."""
    with conformance_server_process(tmp_path_factory.mktemp("flow"), certs_dir, ()) as server:
        yield server


async def test_slow_reader_blocks_the_writer_and_bounds_its_buffer(
    quiet_server: ServerProcess, ca_file: Path
) -> None:
    """HTTP/3 only: what this checks is the transport's own send buffer, visible through
    Control.TransportStats. grpcio's HTTP/2 buffers live in its C core and are not observable,
    so there is no HTTP/2 counterpart to compare against.

    The client reads one message and stops; the server's writer must stop at the high-water
    mark (one message past it at most) instead of queueing the whole stream in memory, and
    everything must still arrive, in order, once the client reads again."""

    async with QuicChannel(f"localhost:{quiet_server.port}", ca_file=str(ca_file)) as channel:
        stub = pb_grpc.TestingStub(channel)
        call = stub.ServerStream(
            pb.EchoRequest(response_count=COUNT, response_size=SIZE), timeout=60
        )
        first = await call.read()
        assert (first.index, len(first.payload)) == (0, SIZE)

        async def writer_blocked() -> bool:
            stats = await transport_stats(quiet_server)
            blocked: bool = stats.h3_blocked_writers >= 1
            return blocked

        await eventually(writer_blocked, "the server's writer waits for the reader")
        stats = await transport_stats(quiet_server)
        assert stats.h3_peak_send_buffered >= SEND_HIGH_WATER
        assert stats.h3_peak_send_buffered <= SEND_HIGH_WATER + MESSAGE_ON_WIRE + SLACK

        indexes = [first.index]
        async for response in call:
            assert len(response.payload) == SIZE
            indexes.append(response.index)
        assert indexes == list(range(COUNT))

        stats = await transport_stats(quiet_server)
        assert stats.h3_blocked_writers == 0
        assert stats.h3_peak_send_buffered <= SEND_HIGH_WATER + MESSAGE_ON_WIRE + SLACK
