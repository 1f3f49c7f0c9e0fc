"""The HTTP/3 receive budget across connections (transport/h3/receive_budget.py): many
connections from one address, each with streams announcing a large message they never finish,
hold no more than the address's budget, and a client from another address is still served."""

from __future__ import annotations

from pathlib import Path

import grpc

from protos.inference import grpc_service_pb2 as pb
from tests.conformance.conftest import eventually
from tests.e2e.test_h3_admission import h3_server, refusals
from tests.framed_h3 import connect_from, framed_call_on
from tests.servers import ServerProcess
from transport.grpc import headers as wire
from transport.grpc.framing import encode_message
from transport.h3.aioquic.connection import send_buffered
from transport.h3.aioquic.credit import NARROW_STREAM_WINDOW
from transport.h3.client import H3ClientConnection, client_configuration
from transport.h3.stream import H3Stream

WINDOW = 1 << 20
BUDGET = 2 * WINDOW  # per address: one full window (half of it), then 16 narrow ones
ADMITTED = 1 + WINDOW // NARROW_STREAM_WINDOW
CONNECTIONS = 8
STREAMS = 4  # per connection: more than the address's budget admits
ANNOUNCED = 60 << 20  # what each message's prefix announces
SENT = 32 << 10  # what each stream sends of it (within a narrow window), then nothing more
HEADERS_ROOM = 4 << 10  # credit a stream's HEADERS frame takes besides its message
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"


async def partial_message(stream: H3Stream, port: int) -> None:
    stream.send_headers(wire.request_headers(f"localhost:{port}", MODEL_INFER, 600))
    await stream.send_data(b"\x00" + ANNOUNCED.to_bytes(4, "big") + bytes(SENT))


def settled(connection: H3ClientConnection, stream: H3Stream) -> bool:
    """Refused (the server answered), or all it sent was taken."""
    refused = stream.headers is not None or stream.error is not None
    return refused or send_buffered(connection.protocol._quic, stream.stream_id) == 0


def credit(connection: H3ClientConnection, stream: H3Stream) -> int:
    """The most the server let the stream send: what it may hold of it."""
    return int(connection.protocol._quic._streams[stream.stream_id].max_stream_data_remote)


async def live(connection: H3ClientConnection, port: int) -> tuple[grpc.StatusCode, str]:
    body = encode_message(pb.ServerLiveRequest().SerializeToString())
    answer = await framed_call_on(connection, port, SERVER_LIVE, body, len(body), len(body))
    return answer.status, answer.message


def front_end(connection: H3ClientConnection) -> int:
    """The front-end holding the connection: the first byte of the connection IDs it issues
    (transport/h3/datagram_routing.py)."""
    return int(connection.protocol._quic._peer_cid.cid[0])


async def hold_partial_messages(
    server: ServerProcess, ca_file: str, front_ends: int = 1
) -> tuple[list[H3ClientConnection], list[tuple[H3ClientConnection, H3Stream]]]:
    """CONNECTIONS connections from 127.0.0.1 (more until `front_ends` of them hold some),
    STREAMS partial messages each, until every stream was refused or took what it sent; the
    connections and the admitted streams."""
    configuration = client_configuration("localhost", ca_file)
    attackers: list[H3ClientConnection] = []
    while len(attackers) < CONNECTIONS or len({front_end(c) for c in attackers}) < front_ends:
        assert len(attackers) < 8 * CONNECTIONS, "the kernel gave every connection one front-end"
        connection = await H3ClientConnection.connect("127.0.0.1", server.port, configuration)
        await connection.wait_connected()
        attackers.append(connection)
    streams = []
    for connection in attackers:
        for _ in range(STREAMS):
            stream = connection.open_stream()
            await partial_message(stream, server.port)
            streams.append((connection, stream))

    async def all_settled() -> bool:
        return all(settled(c, s) for c, s in streams)

    await eventually(all_settled, "every stream refused or its data taken", 600, 0.1)
    for connection in attackers:  # credit sent with the last acknowledgements arrives
        await connection.protocol.ping()
    refused = [s for _, s in streams if s.headers is not None]
    assert len(refused) == refusals(server).get("receive_budget", 0)
    for stream in refused:
        status = wire.parse_trailers(stream.headers or [])
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{BUDGET} bytes not yet read" in status.message
    return attackers, [(c, s) for c, s in streams if s.headers is None and s.error is None]


async def test_many_connections_of_one_address_hold_no_more_than_its_budget(
    tmp_path: Path, certs_dir: Path
) -> None:
    args = ["--h3-receive-budget-per-address", str(BUDGET), "--h3-retry", "never"]
    ca_file = str(certs_dir / "ca.pem")
    with h3_server(tmp_path, certs_dir, args) as server:
        attackers, admitted = await hold_partial_messages(server, ca_file)
        held = sum(credit(c, s) for c, s in admitted)
        assert held <= BUDGET + len(admitted) * HEADERS_ROOM, f"{held} bytes allowed"
        assert len(admitted) == ADMITTED
        assert refusals(server)["receive_budget"] == CONNECTIONS * STREAMS - ADMITTED

        # Another address is served; the attacker's own gets RESOURCE_EXHAUSTED, until its
        # connections are gone and give back what they reserved.
        other = await connect_from("127.0.0.2", server.port, ca_file)
        assert (await live(other, server.port))[0] == grpc.StatusCode.OK
        same = await connect_from("127.0.0.1", server.port, ca_file)
        code, message = await live(same, server.port)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "receive budget" in message
        for connection in attackers:
            await connection.close()

        async def served_again() -> bool:
            return (await live(same, server.port))[0] == grpc.StatusCode.OK

        await eventually(served_again, "the address served once its connections left", 100, 0.1)
        for connection in (other, same):
            await connection.close()


async def test_with_frontends_the_budget_is_the_host_s(tmp_path: Path, certs_dir: Path) -> None:
    """`--frontends 2`: an address's connections spread over the front-ends (by their
    datagrams' hash), which hold no more for it together than its budget: each counts what
    the other holds (service/frontends/host_limits.py)."""
    args = ["--h3-receive-budget-per-address", str(BUDGET), "--h3-retry", "never"]
    ca_file = str(certs_dir / "ca.pem")
    with h3_server(tmp_path, certs_dir, [*args, "--frontends", "2"]) as server:
        attackers, admitted = await hold_partial_messages(server, ca_file, front_ends=2)
        credits = [credit(c, s) for c, s in admitted]
        assert sum(credits) <= BUDGET + len(admitted) * HEADERS_ROOM, f"{credits} bytes allowed"
        # At most one full window: half the budget stays for narrow ones. The first streams of
        # the two front-ends ask at the same instant; if both gave theirs back, every stream
        # has a narrow one, and twice as many are admitted (transport/h3/receive_budget.py).
        wide = [size for size in credits if size > NARROW_STREAM_WINDOW + HEADERS_ROOM]
        assert len(wide) <= 1, credits
        assert len(admitted) >= ADMITTED - 1, credits  # the budget was used
        other = await connect_from("127.0.0.2", server.port, ca_file)
        assert (await live(other, server.port))[0] == grpc.StatusCode.OK
        for connection in [*attackers, other]:
            await connection.close()
