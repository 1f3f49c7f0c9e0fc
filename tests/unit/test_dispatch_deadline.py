"""A call a front-end passed on whose handler outlives its cancel at the deadline and then
answers: the parent ends it DEADLINE_EXCEEDED, as grpc.aio ends such a call, not with the late
answer's status (which reached a client whose own deadline timer was late, under load)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import grpc

from service.frontends.dispatched_call import DispatchedCall
from service.frontends.protocol import Kind, Open
from transport.grpc.handler_table import HandlerTable

METHOD = "/test.Late/Unary"
DEADLINE_S = 0.05


class _Link:
    """The parent's end of a front-end's connection, as a call uses it: frames kept."""

    def __init__(self, table: HandlerTable) -> None:
        self.server = SimpleNamespace(tables={"h2": table}, answered=None, max_message=1 << 20)
        self.sent: list[Kind] = []

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None:
        self.sent.append(kind)

    def give_credit(self, call_id: int) -> None:
        pass


def _table(code: grpc.StatusCode) -> HandlerTable:
    async def late(request: bytes, context: Any) -> bytes:
        with contextlib.suppress(asyncio.CancelledError):  # outlives its cancel, then answers
            await asyncio.sleep(60)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, "the late answer")
        return b"late"

    handler = grpc.unary_unary_rpc_method_handler(late)
    table = HandlerTable()
    table.add_registered_method_handlers("test.Late", {"Unary": handler})
    return table


async def _ended(code: grpc.StatusCode) -> grpc.StatusCode:
    link = _Link(_table(code))
    call = DispatchedCall(link, 1, Open(METHOD, "h2", "ipv4:127.0.0.1:1", DEADLINE_S, ()))  # type: ignore[arg-type]
    call.received(Kind.MESSAGE, b"")
    call.received(Kind.HALF_CLOSE, b"")
    status = await call.run()
    return status.code


async def test_a_late_error_after_the_deadline_is_the_deadline() -> None:
    assert await _ended(grpc.StatusCode.NOT_FOUND) is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_late_answer_after_the_deadline_is_the_deadline() -> None:
    assert await _ended(grpc.StatusCode.OK) is grpc.StatusCode.DEADLINE_EXCEEDED
