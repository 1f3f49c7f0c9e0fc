"""HTTP/3 only, with a bare aioquic client (no paddlequic code on the client side): when the
server answers a call completely while the client is still uploading, it stops the upload with
STOP_SENDING carrying H3_NO_ERROR (RFC 9114 section 4.1.2). H3_REQUEST_CANCELLED there makes
libcurl report a reset and drop the status it had received."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import HeadersReceived
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration

from tests.servers import ServerProcess
from transport.grpc.status import H3_NO_ERROR, H3_REQUEST_CANCELLED

ANSWER_TIMEOUT_S = 30.0
UNARY = b"/paddlequic.v1.Testing/Unary"


class RecordingClient(QuicConnectionProtocol):
    """Keeps every QUIC and HTTP/3 event of its connection."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.h3 = H3Connection(self._quic)
        self.events: list[events.QuicEvent | HeadersReceived] = []
        self.changed = asyncio.Event()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.events.append(event)
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                self.events.append(h3_event)
        self.changed.set()

    def stops(self, stream_id: int) -> list[int]:
        """The codes of the STOP_SENDING frames received for the stream."""
        return [
            e.error_code
            for e in self.events
            if isinstance(e, events.StopSendingReceived) and e.stream_id == stream_id
        ]

    async def wait_for(self, stream_id: int) -> tuple[dict[bytes, bytes], int]:
        """The answer's header block and the STOP_SENDING code, once both arrived."""
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            while True:
                headers = [
                    e
                    for e in self.events
                    if isinstance(e, HeadersReceived) and e.stream_id == stream_id
                ]
                stops = self.stops(stream_id)
                if headers and stops:
                    return dict(headers[0].headers), stops[0]
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def client(
    conformance_server: ServerProcess, ca_file: Path
) -> AsyncIterator[RecordingClient]:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.load_verify_locations(cafile=str(ca_file))
    configuration.server_name = "localhost"
    async with connect(
        "127.0.0.1", conformance_server.port, configuration=configuration,
        create_protocol=RecordingClient,
    ) as protocol:  # fmt: skip
        assert isinstance(protocol, RecordingClient)
        yield protocol


def request(port: int, path: bytes, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":authority", b"localhost:%d" % port),
        (b":path", path),
        (b"content-type", b"application/grpc"),
        *extra,
    ]


# Each case: the request's path and extra headers, the first bytes of its body (the upload
# then stays open), and the grpc-status of the complete answer.
CASES = {
    "unknown-method": (b"/no.such.Service/Method", (), struct.pack(">BI", 0, 1 << 20), b"12"),
    "refused-encoding": (UNARY, ((b"grpc-encoding", b"snappy"),), b"", b"12"),
    "oversized-message": (UNARY, (), struct.pack(">BI", 0, 100 << 20), b"8"),
    "deadline-during-upload": (UNARY, ((b"grpc-timeout", b"1S"),), struct.pack(">BI", 0, 64), b"4"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_complete_answer_stops_the_upload_with_h3_no_error(
    client: RecordingClient, conformance_server: ServerProcess, case: str
) -> None:
    path, extra, body, status = CASES[case]
    stream_id = client._quic.get_next_available_stream_id()
    client.h3.send_headers(stream_id, request(conformance_server.port, path, *extra))
    client.h3.send_data(stream_id, body, end_stream=False)
    client.transmit()
    headers, code = await client.wait_for(stream_id)
    assert headers[b"grpc-status"] == status
    assert code == H3_NO_ERROR, f"STOP_SENDING carried 0x{code:x}"


async def test_a_call_that_ends_without_an_answer_stops_the_upload_as_cancelled(
    client: RecordingClient, conformance_server: ServerProcess
) -> None:
    """The client resets its request while the handler waits for more: the server answers
    nothing and stops the upload with H3_REQUEST_CANCELLED."""
    stream_id = client._quic.get_next_available_stream_id()
    path = b"/paddlequic.v1.Testing/ClientStream"
    client.h3.send_headers(stream_id, request(conformance_server.port, path))
    client.h3.send_data(stream_id, struct.pack(">BI", 0, 0), end_stream=False)
    client.transmit()
    client._quic.reset_stream(stream_id, H3_REQUEST_CANCELLED)
    client.transmit()
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        while not (stops := client.stops(stream_id)):
            client.changed.clear()
            await client.changed.wait()
    assert stops == [H3_REQUEST_CANCELLED]
    assert not [
        e for e in client.events if isinstance(e, HeadersReceived) and e.stream_id == stream_id
    ]
