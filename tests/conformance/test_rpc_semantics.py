"""The four RPC kinds, request iterators and the write/read call API, status codes and
messages, Trailers-Only errors, custom metadata, deadlines and cancellation, through
paddlequic.v1.Testing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2 as pb
from protos.paddlequic.v1 import testing_pb2_grpc as pb_grpc
from tests.conformance.conftest import EOF, ChannelFactory, eventually, x_entries
from tests.servers import ServerProcess
from transport.grpc import headers as wire

# Non-ASCII, '%' and things that look like percent-escapes: must arrive exactly as sent.
TRICKY_MESSAGE = "modèle «introuvable» 100% - %41%zz ✓ 模型 \U0001f50d"


def requests(count: int, size: int = 3) -> list[pb.EchoRequest]:
    return [pb.EchoRequest(payload=bytes([i]) * size) for i in range(count)]


# the four RPC kinds


async def test_unary(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        response = await stub.Unary(pb.EchoRequest(payload=b"hello"), timeout=10)
        assert response.payload == b"hello"
        call = stub.Unary(pb.EchoRequest(payload=b""))
        assert (await call).payload == b""
        assert await call.code() == grpc.StatusCode.OK
        assert await call.details() == ""
        assert call.done()
        assert not call.cancelled()


async def test_server_stream_async_iteration_and_read(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(response_count=5, response_size=3)
        call = stub.ServerStream(request, timeout=10)
        responses = [response async for response in call]
        assert [(r.index, r.payload) for r in responses] == [(i, b"xxx") for i in range(5)]
        assert await call.code() == grpc.StatusCode.OK

        call = stub.ServerStream(request, timeout=10)
        indexes = []
        while (response := await call.read()) != EOF:
            indexes.append(response.index)
        assert indexes == list(range(5))
        assert await call.code() == grpc.StatusCode.OK

        empty = stub.ServerStream(pb.EchoRequest(response_count=0), timeout=10)
        assert [r async for r in empty] == []
        assert await empty.code() == grpc.StatusCode.OK


async def test_client_stream_request_iterators(make_channel: ChannelFactory) -> None:
    async def agen() -> AsyncIterator[pb.EchoRequest]:
        for request in requests(4):
            await asyncio.sleep(0)
            yield request

    def gen() -> Iterator[pb.EchoRequest]:
        yield from requests(6)

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        response = await stub.ClientStream(agen(), timeout=10)
        assert (response.messages, response.total_bytes) == (4, 12)
        response = await stub.ClientStream(gen(), timeout=10)
        assert (response.messages, response.total_bytes) == (6, 18)
        response = await stub.ClientStream(iter(requests(2, 1000)), timeout=10)
        assert (response.messages, response.total_bytes) == (2, 2000)
        response = await stub.ClientStream(iter([]), timeout=10)
        assert (response.messages, response.total_bytes) == (0, 0)


async def test_client_stream_write_and_done_writing(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        call = stub.ClientStream(timeout=10)
        for request in requests(3, 5):
            await call.write(request)
        await call.done_writing()
        response = await call
        assert (response.messages, response.total_bytes) == (3, 15)
        assert await call.code() == grpc.StatusCode.OK


async def test_bidi_stream_request_iterators(make_channel: ChannelFactory) -> None:
    async def agen() -> AsyncIterator[pb.EchoRequest]:
        for request in requests(5):
            yield request

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        for source in (agen(), iter(requests(5))):
            call = stub.BidiStream(source, timeout=10)
            responses = [r async for r in call]
            assert [(r.index, r.payload) for r in responses] == [
                (i, bytes([i]) * 3) for i in range(5)
            ]
            assert await call.code() == grpc.StatusCode.OK
        empty = stub.BidiStream(iter([]), timeout=10)
        assert [r async for r in empty] == []


async def test_bidi_stream_ping_pong_with_write_and_read(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        call = stub.BidiStream(timeout=10)
        for i in range(10):
            await call.write(pb.EchoRequest(payload=str(i).encode()))
            response = await call.read()
            assert (response.index, response.payload) == (i, str(i).encode())
        await call.done_writing()
        assert await call.read() == EOF
        assert await call.code() == grpc.StatusCode.OK


async def test_unknown_method_is_unimplemented(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        method = channel.unary_unary(
            "/paddlequic.v1.Testing/NoSuchMethod",
            request_serializer=None,
            response_deserializer=None,
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await method(b"", timeout=10)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


# status codes and messages


async def test_every_status_code_and_message_round_trip(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        for code in grpc.StatusCode:
            if code == grpc.StatusCode.OK:
                continue
            message = f"{code.name}: {TRICKY_MESSAGE}"
            request = pb.EchoRequest(status_code=code.value[0], status_message=message)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Unary(request, timeout=10)
            assert (error.value.code(), error.value.details()) == (code, message)


async def test_a_handler_that_raises_still_ends_its_call(make_channel: ChannelFactory) -> None:
    """A bug in a handler (an exception, not an abort), before or after a response: the call
    ends with UNKNOWN naming the exception, and the connection goes on serving."""

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        failing = pb.EchoRequest(raise_error=True, status_message="bug")
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Unary(failing, timeout=10)
        assert unary.value.code() == grpc.StatusCode.UNKNOWN
        assert "RuntimeError" in (unary.value.details() or "")
        stream = stub.BidiStream(iter([pb.EchoRequest(payload=b"a"), failing]), timeout=10)
        assert (await stream.read()).payload == b"a"
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            await stream.read()
        assert streamed.value.code() == grpc.StatusCode.UNKNOWN
        assert (await stub.Unary(pb.EchoRequest(payload=b"ok"), timeout=10)).payload == b"ok"


async def test_trailers_only_error(make_channel: ChannelFactory) -> None:
    """An abort before any response: no initial metadata, no message, the status."""

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(status_code=5, status_message=TRICKY_MESSAGE)
        call = stub.Unary(request, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert error.value.details() == TRICKY_MESSAGE
        assert x_entries(await call.initial_metadata()) == []
        assert x_entries(await call.trailing_metadata()) == []
        assert await call.code() == grpc.StatusCode.NOT_FOUND
        assert await call.details() == TRICKY_MESSAGE
        if isinstance(channel, QuicChannel):
            # On the wire (only visible over HTTP/3): one HEADERS frame, with the status.
            stream = call._stream
            assert stream.trailers is None
            assert wire.is_trailers_only(stream.headers)

        stream = stub.ServerStream(
            pb.EchoRequest(response_count=3, status_code=7, status_message="no"), timeout=10
        )
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for response in stream:
                received.append(response)
        assert received == []
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "no",
        )


async def test_error_after_some_stream_responses(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        failing = pb.EchoRequest(status_code=9, status_message=TRICKY_MESSAGE)

        async def until_failed() -> AsyncIterator[pb.EchoRequest]:
            """The requests up to the failing one, then nothing (no write, no half-close)
            until the call has its status. A write that grpc.aio issues after the server
            ended the call fails, and grpc.aio then reports INTERNAL ("Internal error from
            Core") in place of the server's status when that failure comes first
            (grpc/grpc#36066); a half-close that failed would cancel the call."""
            for request in [*requests(2), failing]:
                yield request
            await stream.code()

        stream = stub.BidiStream(until_failed(), timeout=10)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for response in stream:
                received.append(response.index)
        assert received == [0, 1]
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.value.details() == TRICKY_MESSAGE
        assert await stream.code() == grpc.StatusCode.FAILED_PRECONDITION

        call = stub.BidiStream(timeout=10)
        await call.write(pb.EchoRequest(payload=b"a"))
        assert (await call.read()).payload == b"a"
        await call.write(failing)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call.read()
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert await call.details() == TRICKY_MESSAGE


# custom metadata


def _metadata() -> tuple[tuple[str, str | bytes], ...]:
    return (
        ("x-ascii", "hello world"),
        ("x-data-bin", b"\x00\xff\x10 binary \xfe"),
        ("x-multi", "a"),
        ("x-multi", "b"),
        ("other", "not echoed"),
    )


ECHOED = [entry for entry in _metadata() if entry[0].startswith("x-")]


async def test_metadata_round_trip_unary(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        call = stub.Unary(pb.EchoRequest(echo_metadata=True), metadata=_metadata())
        assert x_entries(await call.initial_metadata()) == ECHOED
        await call
        assert x_entries(await call.trailing_metadata()) == ECHOED


async def test_metadata_round_trip_streams(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(echo_metadata=True, response_count=2, response_size=1)
        call = stub.ServerStream(request, metadata=_metadata(), timeout=10)
        assert x_entries(await call.initial_metadata()) == ECHOED
        assert len([r async for r in call]) == 2
        assert x_entries(await call.trailing_metadata()) == ECHOED

        call = stub.BidiStream(metadata=_metadata(), timeout=10)
        await call.write(pb.EchoRequest(echo_metadata=True))
        assert x_entries(await call.initial_metadata()) == ECHOED
        await call.read()
        await call.done_writing()
        assert await call.read() == EOF
        assert x_entries(await call.trailing_metadata()) == ECHOED


async def test_metadata_with_an_error(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        request = pb.EchoRequest(echo_metadata=True, status_code=10, status_message="abort")
        call = stub.Unary(request, metadata=_metadata(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert x_entries(error.value.initial_metadata()) == ECHOED
        assert x_entries(error.value.trailing_metadata()) == ECHOED
        assert x_entries(await call.trailing_metadata()) == ECHOED


# deadlines and cancellation


DEADLINE_S = 2.0


async def handler_cancelled(stub: pb_grpc.TestingStub, token: str) -> bool:
    response = await stub.HandlerCancelled(pb.EchoRequest(token=token), timeout=10)
    cancelled: bool = response.cancelled
    return cancelled


async def wait_handler_sleeping(call: Any, stub: pb_grpc.TestingStub, token: str) -> None:
    """Return once the handler of `call` (asked for echo_metadata and a sleep) sleeps.

    It sends its headers and then sleeps; the client having the headers is not quite enough
    with grpc.aio, whose handler resumes after its send completes, which the server's event
    loop may learn after the client got the headers. One more call to the same server is
    dispatched after that completion, so once it is answered the handler sleeps."""
    await call.initial_metadata()
    assert not await handler_cancelled(stub, token)


async def test_deadline_exceeded_on_both_ends(make_channel: ChannelFactory) -> None:
    """The handler must be running when the deadline passes to see it: the channel connects
    first, and the deadline leaves a loaded machine ample time to start the handler."""
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        await stub.Unary(pb.EchoRequest(payload=b"connect"), timeout=30)
        token = uuid.uuid4().hex
        call = stub.Unary(pb.EchoRequest(sleep_seconds=60, token=token), timeout=DEADLINE_S)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: handler_cancelled(stub, token), "the handler saw the deadline")

        token = uuid.uuid4().hex
        stream = stub.ServerStream(
            pb.EchoRequest(sleep_seconds=60, token=token, response_count=1), timeout=DEADLINE_S
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream.read()
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(
            lambda: handler_cancelled(stub, token), "the stream handler saw the deadline"
        )


async def test_h3_a_call_longer_than_the_unresponsive_timeout_succeeds(
    conformance_server: ServerProcess, ca_file: Path
) -> None:
    """HTTP/3 only: the server sends nothing while the call sleeps, yet its QUIC stack
    acknowledges the channel's PINGs, so the connection is not taken for dead. The timeout is
    long enough that a loaded machine never misses it by accident (the server's ACK of a PING
    sent every 0.75 s has 3 s to come); the call sleeps twice as long."""
    async with QuicChannel(
        f"localhost:{conformance_server.port}", ca_file=str(ca_file), unresponsive_timeout_s=3.0
    ) as channel:
        stub = pb_grpc.TestingStub(channel)
        await stub.Unary(pb.EchoRequest(payload=b"first"), timeout=30)
        connection = await channel.connection()
        slow = pb.EchoRequest(payload=b"late", sleep_seconds=6.0)
        assert (await stub.Unary(slow, timeout=30)).payload == b"late"
        assert await channel.connection() is connection


async def test_cancelling_a_unary_call(make_channel: ChannelFactory) -> None:
    """What the application sees; whether the handler notices is tested below."""

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        call = stub.Unary(pb.EchoRequest(sleep_seconds=60), timeout=30)
        assert call.cancel()
        assert call.cancelled()
        assert call.done()
        assert not call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await call.code() == grpc.StatusCode.CANCELLED
        # The channel still works.
        assert (await stub.Unary(pb.EchoRequest(payload=b"ok"), timeout=10)).payload == b"ok"


async def test_client_cancellation_reaches_a_unary_handler(make_channel: ChannelFactory) -> None:
    """Testing.Unary called through a unary-stream multicallable (the same bytes on the wire):
    grpc.aio only reports a unary-unary call's initial metadata at its end, and the early
    headers are how the test knows the handler runs before it cancels."""

    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        unary = channel.unary_stream(
            "/paddlequic.v1.Testing/Unary",
            request_serializer=pb.EchoRequest.SerializeToString,
            response_deserializer=pb.EchoResponse.FromString,
        )
        token = uuid.uuid4().hex
        # echo_metadata: the handler sends headers right before it sleeps.
        request = pb.EchoRequest(sleep_seconds=60, token=token, echo_metadata=True)
        call = unary(request, timeout=30)
        await wait_handler_sleeping(call, stub, token)
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: handler_cancelled(stub, token), "the handler was cancelled")


async def test_client_cancellation_reaches_a_server_stream_handler(
    make_channel: ChannelFactory,
) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        token = uuid.uuid4().hex
        request = pb.EchoRequest(
            sleep_seconds=60, token=token, echo_metadata=True, response_count=1
        )
        call = stub.ServerStream(request, timeout=30)
        await wait_handler_sleeping(call, stub, token)
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            async for _ in call:
                pass
        assert await call.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: handler_cancelled(stub, token), "the handler was cancelled")


async def test_client_cancellation_of_a_stream(make_channel: ChannelFactory) -> None:
    async with make_channel() as channel:
        stub = pb_grpc.TestingStub(channel)
        token = uuid.uuid4().hex
        call = stub.BidiStream(timeout=30)
        await call.write(pb.EchoRequest(sleep_seconds=60, token=token, echo_metadata=True))
        await wait_handler_sleeping(call, stub, token)
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: handler_cancelled(stub, token), "the handler was cancelled")
