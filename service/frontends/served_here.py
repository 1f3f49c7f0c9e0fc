"""A ModelInfer call a front-end serves itself (on a version it queues for itself:
shared_versions.py), as the parent serves a described call (described_call.py): observed,
access-checked and run by the same code, into a worker's queue and back, with no part for the
parent; its answer is the response message at once."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from service.frontends.described_call import DescribedCall, Serving
from service.frontends.descriptors import DescribedAnswer, DescribedRequest
from service.frontends.model_view import response_message
from service.frontends.protocol import Kind, Open, Status, decode_status
from service.registry.versions import ServedVersion


async def serve_here(
    serving: Serving,
    opened: Open,
    described: DescribedRequest,
    served: ServedVersion,
    context: Any,
) -> bytes:
    """The call's response message, or its status as `context.abort`."""
    link = _AnsweredHere()
    call = _ServedHere(link, 0, opened, served, described, serving)
    call.start()
    try:
        data, status = await link.done
    except asyncio.CancelledError:  # the client left
        call.cancel()
        raise
    if status.code is not grpc.StatusCode.OK:
        await context.abort(status.code, status.details, status.trailing)
    return data


class _ServedHere(DescribedCall):
    """A described call this process serves itself: its answer is the response message."""

    def encode(self, answer: DescribedAnswer) -> bytes:
        return response_message(answer)


class _AnsweredHere:
    """The link of a call this process serves: its answer and status, when they come."""

    def __init__(self) -> None:
        self.done: asyncio.Future[tuple[bytes, Status]] = asyncio.get_running_loop().create_future()
        self._data = b""

    def send(self, kind: Kind, call_id: int, payload: bytes = b"") -> None:
        if kind is Kind.MESSAGE:
            self._data = payload
        elif kind is Kind.STATUS and not self.done.done():
            self.done.set_result((self._data, decode_status(payload)))

    def flush_large(self) -> None:
        pass

    def ended(self, call_id: int) -> None:
        pass
