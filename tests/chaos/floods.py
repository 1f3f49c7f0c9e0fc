"""Attacks by volume: random model names, a flood of QUIC Initials, thousands of idle
connections, peers holding /metrics connections."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import string
import time
from urllib.parse import urlsplit

import numpy as np
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from clients.inference_client import build_request
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from service.observability.scrape_bounds import DEFAULT_MAX_CONNECTIONS
from tests.chaos.harness import (
    METRICS_TIMEOUT_S,
    TRANSPORTS,
    AttackResult,
    Scale,
    Target,
    outcomes_of,
    status_name,
)
from tests.servers import stream_closed_by_peer
from transport.h3.client import client_configuration

NAME_LENGTH = 60
CONCURRENCY = 16
CALL_TIMEOUT_S = 20.0
METRICS_GROWTH_LIMIT = 64 << 10  # /metrics may grow by known models, never per unknown name
# Long header packet types of QUIC v1 (RFC 9000, 17.2), by bits 4-5 of the first byte.
LONG_HEADER_TYPES = ("Initial", "0-RTT", "Handshake", "Retry")
# Floods and idle connections come from another loopback address than the good clients: a host
# of its own, as on the internet, so the per-address limit is what holds it back (on one
# address the attacker would lock the good clients out with it).
ATTACKER_HOST = "127.0.0.2"
# How many /metrics connections the chaos server holds at once (--metrics-max-connections'
# default): a flood of them grows its threads by that, at most.
METRICS_HELD = DEFAULT_MAX_CONNECTIONS
METRICS_CLOSED_AT_ONCE = "closed as it was accepted"
METRICS_CLOSED_IN_TIME = "closed at its time"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")


async def random_names(target: Target, scale: Scale) -> AttackResult:
    """ModelInfer on random 60-character names: NOT_FOUND each time, and the metrics must not
    grow a series per name."""
    result = AttackResult()
    metrics_before = await asyncio.to_thread(target.metrics_bytes)
    inputs = {"input": np.zeros((1, 256), np.float32)}
    alphabet = string.ascii_letters + string.digits
    rng = random.Random(10)
    for transport in TRANSPORTS:
        async with target.channel(transport) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            calls = (
                stub.ModelInfer(
                    build_request("".join(rng.choices(alphabet, k=NAME_LENGTH)), inputs),
                    timeout=CALL_TIMEOUT_S,
                )
                for _ in range(scale.names)
            )
            result.outcomes.update(await outcomes_of(calls, CONCURRENCY, CALL_TIMEOUT_S))
    growth = await asyncio.to_thread(target.metrics_bytes) - metrics_before
    result.notes["metrics_growth_bytes"] = growth
    if growth > METRICS_GROWTH_LIMIT:
        result.problems.append(f"/metrics grew by {growth} bytes for unknown model names")
    return result


def _reply_kind(datagram: bytes) -> str:
    if not datagram or not datagram[0] & 0x80:
        return "server replied short header"
    if datagram[1:5] == b"\0\0\0\0":
        return "server replied Version Negotiation"
    return f"server replied {LONG_HEADER_TYPES[(datagram[0] >> 4) & 0x3]}"


async def initial_flood(target: Target, scale: Scale) -> AttackResult:
    """Real QUIC Initials (each from a new client connection) from one UDP socket, never
    answered: what the server sends back is counted by packet type."""
    result = AttackResult()
    address = ("127.0.0.1", target.port)
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=H3_ALPN, server_name="localhost"
    )
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind((ATTACKER_HOST, 0))
        sock.setblocking(False)

        def drain() -> None:
            with contextlib.suppress(BlockingIOError):
                while True:
                    result.outcomes[_reply_kind(sock.recv(65536))] += 1

        for index in range(scale.initials):
            quic = QuicConnection(configuration=configuration)
            quic.connect(address, now=time.monotonic())
            for data, _ in quic.datagrams_to_send(now=time.monotonic()):
                sock.sendto(data, address)
            result.notes["initials_sent"] = index + 1
            drain()
            await asyncio.sleep(0)
        # Replies still on their way: wait for them, a bounded while.
        deadline = loop.time() + 1.0
        while loop.time() < deadline:
            drain()
            await asyncio.sleep(0.05)
    if not result.outcomes:
        result.outcomes["refused at transport"] = scale.initials
    return result


class _IdleConnection(QuicConnectionProtocol):
    """A QUIC connection that only completes its handshake, then notes whether it stays open."""

    open = True

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.ConnectionTerminated):
            self.open = False

    def abandon(self) -> None:
        """Close the connection and its socket (aioquic's connect() would do both)."""
        self.close()
        if self._transport is not None:
            self._transport.close()


async def _h3_handshake(target: Target) -> tuple[str, _IdleConnection | None]:
    configuration = client_configuration("localhost", str(target.ca_file))
    loop = asyncio.get_running_loop()
    try:
        _, protocol = await loop.create_datagram_endpoint(
            lambda: _IdleConnection(QuicConnection(configuration=configuration)),
            local_addr=(ATTACKER_HOST, 0),
        )
    except OSError as exc:
        return status_name(exc), None
    try:
        protocol.connect(("127.0.0.1", target.port))
        await asyncio.wait_for(protocol.wait_connected(), CALL_TIMEOUT_S)
    except Exception as exc:
        protocol.abandon()
        return status_name(exc), None
    return "connected", protocol


async def _h2_connection(target: Target) -> tuple[str, asyncio.StreamWriter | None]:
    """A connection counts as held once the server's SETTINGS arrive; one the server closes
    at once was refused."""
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", target.port, local_addr=(ATTACKER_HOST, 0)
        )
        writer.write(HTTP2_PREFACE)
        settings = await asyncio.wait_for(reader.read(9), CALL_TIMEOUT_S)
    except Exception as exc:
        return status_name(exc), None
    if not settings:
        writer.close()
        return "refused at transport", None
    return "connected", writer


async def idle_connections(target: Target, scale: Scale) -> AttackResult:
    """Completed HTTP/3 handshakes and HTTP/2 connections (preface and SETTINGS sent) that
    then do nothing, all held open together for a while."""
    result = AttackResult()
    h3: list[_IdleConnection] = []
    h2: list[asyncio.StreamWriter] = []
    try:
        for start in range(0, scale.idle_h3, CONCURRENCY):
            batch = min(CONCURRENCY, scale.idle_h3 - start)
            for kind, connection in await asyncio.gather(
                *(_h3_handshake(target) for _ in range(batch))
            ):
                result.outcomes[f"h3 {kind}"] += 1
                if connection is not None:
                    h3.append(connection)
        for kind, writer in await asyncio.gather(
            *(_h2_connection(target) for _ in range(scale.idle_h2))
        ):
            result.outcomes[f"h2 {kind}"] += 1
            if writer is not None:
                h2.append(writer)
        await asyncio.sleep(scale.idle_hold_s)
        result.notes["h3_open_after_hold"] = sum(c.open for c in h3)
    finally:
        for writer in h2:
            writer.close()
        for protocol in h3:
            protocol.abandon()
    return result


async def metrics_connections(target: Target, scale: Scale) -> AttackResult:
    """`metrics_connections` peers connect to /metrics at once and send the start of a
    request line, never its end. The listener holds at most its bound (the others closed as
    they are accepted), each until its time; the server's threads grow by that bound at most,
    where each connection used to hold a thread for as long as its peer liked."""
    result = AttackResult()
    address = urlsplit(target.metrics_url)
    threads = f"/proc/{target.pid}/task"
    before = len(os.listdir(threads))
    opened = await asyncio.gather(
        *(
            asyncio.open_connection(address.hostname, address.port, local_addr=(ATTACKER_HOST, 0))
            for _ in range(scale.metrics_connections)
        )
    )
    try:
        for _, writer in opened:
            writer.write(b"GET /metr")
        closed_at_once = await asyncio.gather(*(stream_closed_by_peer(r, 0.5) for r, _ in opened))
        grown = len(os.listdir(threads)) - before
        result.notes["server_threads_grown"] = grown
        if grown > METRICS_HELD + 8:  # other threads of the server's come and go
            result.problems.append(f"the server's threads grew by {grown} for /metrics peers")
        held = [
            reader for (reader, _), gone in zip(opened, closed_at_once, strict=True) if not gone
        ]
        closed_later = await asyncio.gather(
            *(stream_closed_by_peer(r, METRICS_TIMEOUT_S * 5) for r in held)
        )
        result.outcomes.update(
            [METRICS_CLOSED_AT_ONCE] * (len(opened) - len(held))
            + [METRICS_CLOSED_IN_TIME if gone else "held past its time" for gone in closed_later]
        )
    finally:
        for _, writer in opened:
            writer.close()
    return result
