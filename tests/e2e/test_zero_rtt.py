"""0-RTT resumption against the real server: single-use tickets, TTL, the early-data policy,
persistence across client processes, and reconnecting after a server restart."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from protos.paddlequic.v1 import control_pb2, testing_pb2, testing_pb2_grpc
from tests.servers import REPO_ROOT, ServerProcess, model_repository, running_server
from transport.h3.client import H3ClientConnection, client_configuration

REQUEST = build_request("mlp", {"input": np.ones((1, 256), np.float32)})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("zero-rtt")
    args = ["--testing-service", "--certs-dir", str(certs_dir)]
    with running_server(model_repository(root / "models", ["mlp"]), root / "log", args) as s:
        yield s


def channel(
    server: ServerProcess, certs_dir: Path, cache: SessionTicketCache, **kw: object
) -> QuicChannel:
    return QuicChannel(
        f"localhost:{server.port}",
        ca_file=str(certs_dir / "ca.pem"),
        ticket_cache=cache,
        **kw,  # type: ignore[arg-type]
    )


async def infer_once(
    server: ServerProcess, certs_dir: Path, cache: SessionTicketCache
) -> str | None:
    """One new connection, one ModelInfer; the connect mode the client saw."""
    async with channel(server, certs_dir, cache) as ch:
        await pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(REQUEST, timeout=30)
    return ch.last_connect_mode


def stats(server: ServerProcess) -> control_pb2.TransportStatsResponse:
    response: control_pb2.TransportStatsResponse = server.control.TransportStats(
        control_pb2.TransportStatsRequest(), timeout=5
    )
    return response


async def test_resumed_connection_sends_its_first_request_as_early_data(
    server: ServerProcess, certs_dir: Path
) -> None:
    before = stats(server)
    cache = SessionTicketCache()
    modes = [await infer_once(server, certs_dir, cache) for _ in range(3)]
    assert modes == ["full", "0rtt-accepted", "0rtt-accepted"]
    after = stats(server)
    accepted = after.h3_handshakes["0rtt_accepted"] - before.h3_handshakes["0rtt_accepted"]
    assert accepted == 2  # the server saw early data accepted on the wire, twice


async def test_every_reconnect_resumes_even_when_the_client_closes_at_its_answer(
    server: ServerProcess, certs_dir: Path
) -> None:
    """The ticket comes with the server's Finished, so a client that closes as soon as its
    answer arrived (not waiting for a ticket) holds the next one every time."""
    before = stats(server).h3_handshakes["0rtt_accepted"]
    cache = SessionTicketCache()

    async def answer_and_close() -> str | None:
        async with channel(server, certs_dir, cache, ticket_wait_s=0.0) as ch:
            await pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(REQUEST, timeout=30)
        return ch.last_connect_mode

    modes = [await answer_and_close() for _ in range(21)]
    assert modes == ["full"] + ["0rtt-accepted"] * 20
    assert stats(server).h3_handshakes["0rtt_accepted"] - before == 20


async def test_a_resumed_connection_sends_nothing_before_its_first_call_is_written(
    server: ServerProcess, certs_dir: Path
) -> None:
    """Its ClientHello waits for the end of the event-loop turn, so a call opened in the same
    turn leaves in the same transmit (one pass of aioquic's packet builder)."""
    cache = SessionTicketCache()
    await infer_once(server, certs_dir, cache)
    ticket = cache.take(SessionTicketCache.key("localhost", "localhost", server.port))
    assert ticket is not None
    configuration = client_configuration(
        "localhost", str(certs_dir / "ca.pem"), session_ticket=ticket
    )
    connection = await H3ClientConnection.connect("localhost", server.port, configuration)
    try:
        assert connection.may_send_early
        assert connection.protocol._quic._loss.bytes_in_flight == 0
        await asyncio.wait_for(connection.wait_connected(), 10)
    finally:
        await connection.close()


async def test_a_replayed_ticket_gets_a_full_handshake_and_its_early_data_rejected(
    server: ServerProcess, certs_dir: Path
) -> None:
    cache = SessionTicketCache()
    await infer_once(server, certs_dir, cache)
    key = SessionTicketCache.key("localhost", "localhost", server.port)
    ticket = cache.take(key)
    assert ticket is not None
    first, replay = SessionTicketCache(), SessionTicketCache()
    first.add(key, ticket)
    replay.add(key, copy.deepcopy(ticket))
    refused_before = stats(server).h3_tickets["refused"]
    assert await infer_once(server, certs_dir, first) == "0rtt-accepted"
    # The same ticket again: the server already consumed it, so early data is refused and
    # the request still completes after a full handshake.
    assert await infer_once(server, certs_dir, replay) == "0rtt-rejected"
    assert stats(server).h3_tickets["refused"] == refused_before + 1


async def test_expired_tickets_are_refused(tmp_path: Path, certs_dir: Path) -> None:
    args = ["--certs-dir", str(certs_dir), "--ticket-ttl", "0"]
    repo = model_repository(tmp_path / "models", ["mlp"])
    with running_server(repo, tmp_path / "log", args) as short_lived:
        cache = SessionTicketCache()
        assert await infer_once(short_lived, certs_dir, cache) == "full"
        assert await infer_once(short_lived, certs_dir, cache) == "0rtt-rejected"
        assert stats(short_lived).h3_tickets["refused"] == 1


async def test_a_request_outside_the_policy_runs_once_after_the_handshake(
    server: ServerProcess, certs_dir: Path
) -> None:
    """The client is told Testing/Unary may go early; the server's allowlist says no: the
    request is held until the handshake completes and runs exactly once."""
    held_before = stats(server).h3_handshakes["early_requests_held"]
    cache = SessionTicketCache()
    await infer_once(server, certs_dir, cache)

    async def unsafe_early_call() -> str | None:
        async with channel(
            server, certs_dir, cache, early_data_methods=frozenset({"/paddlequic.v1.Testing/*"})
        ) as ch:
            stub = testing_pb2_grpc.TestingStub(ch)
            await stub.Unary(testing_pb2.EchoRequest(token="load-once"), timeout=30)
            count = await stub.Executions(testing_pb2.EchoRequest(token="load-once"), timeout=30)
            assert count.messages == 1
        return ch.last_connect_mode

    assert await unsafe_early_call() == "0rtt-accepted"
    assert stats(server).h3_handshakes["early_requests_held"] == held_before + 1


CLIENT = """
import asyncio, sys, numpy as np
from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from clients.tickets import SessionTicketCache
from protos.inference import grpc_service_pb2_grpc as pb_grpc

async def main() -> None:
    cache = SessionTicketCache(sys.argv[3])
    async with QuicChannel(sys.argv[1], ca_file=sys.argv[2], ticket_cache=cache) as ch:
        request = build_request("mlp", {"input": np.ones((1, 256), np.float32)})
        await pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(request, timeout=30)
    print(ch.last_connect_mode)

asyncio.run(main())
"""


def test_tickets_persist_across_client_processes(
    server: ServerProcess, certs_dir: Path, tmp_path: Path
) -> None:
    tickets = tmp_path / "edge-tickets.json"

    def run_client() -> str:
        args = [f"localhost:{server.port}", str(certs_dir / "ca.pem"), str(tickets)]
        result = subprocess.run(
            [sys.executable, "-c", CLIENT, *args],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
            check=True,
        )
        return result.stdout.strip()

    assert run_client() == "full"
    assert tickets.stat().st_mode & 0o777 == 0o600
    assert run_client() == "0rtt-accepted"


async def test_reconnect_after_a_server_restart_then_resume(
    tmp_path: Path, certs_dir: Path
) -> None:
    repo = model_repository(tmp_path / "models", ["mlp"])
    args = ["--certs-dir", str(certs_dir)]

    async def calls(ch: QuicChannel, count: int) -> None:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        for _ in range(count):
            await stub.ModelInfer(REQUEST, timeout=60)

    cache = SessionTicketCache()
    with running_server(repo, tmp_path / "first.log", args) as first:
        assert await infer_once(first, certs_dir, cache) == "full"
    with running_server(repo, tmp_path / "second.log", args, port=first.port) as second:
        # The restarted server forgot its tickets: early data is refused, the call completes.
        assert await infer_once(second, certs_dir, cache) == "0rtt-rejected"
        assert await infer_once(second, certs_dir, cache) == "0rtt-accepted"

        async def one_channel_across_idle() -> list[str | None]:
            modes = []
            # Long enough that the call never sees it on a slow machine; the close it makes is
            # then waited for with a deadline ten times longer, and shorter than the server's
            # own idle timeout (60 s), which would close the connection too.
            async with channel(second, certs_dir, cache, idle_timeout_s=3.0) as ch:
                await calls(ch, 1)
                modes.append(ch.last_connect_mode)
                await asyncio.wait_for(ch._connection.protocol.wait_closed(), 30)  # type: ignore[union-attr]
                await calls(ch, 1)  # idle timeout closed it: reconnects, resuming
                modes.append(ch.last_connect_mode)
            return modes

        assert await one_channel_across_idle() == ["0rtt-accepted", "0rtt-accepted"]


async def test_no_zero_rtt_keeps_resumption_without_early_data(
    tmp_path: Path, certs_dir: Path
) -> None:
    args = ["--certs-dir", str(certs_dir), "--no-zero-rtt"]
    repo = model_repository(tmp_path / "models", ["mlp"])
    with running_server(repo, tmp_path / "log", args) as plain:
        cache = SessionTicketCache()
        assert await infer_once(plain, certs_dir, cache) == "full"
        assert await infer_once(plain, certs_dir, cache) == "resumed"
        assert stats(plain).h3_handshakes["0rtt_accepted"] == 0


def test_h2_is_unaffected(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as ch:
        assert (
            pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(REQUEST, timeout=30).model_name == "mlp"
        )
