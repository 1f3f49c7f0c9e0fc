"""The REST listener's bound on sending an answer (listener.sending_within): a body goes out
whole and in order, in pieces of at most SEND_PIECE, the stream kept open until its last; a
piece the client does not take within the timeout resets the connection and ends the app
quietly."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from service.http.bounds import SEND_PIECE
from service.http.listener import sending_within

Message = dict[str, Any]


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


async def _run(app: Any, send: Any) -> None:
    await app({"type": "http"}, _nothing, send)


def _app(messages: list[Message]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        for message in messages:
            await send(message)

    return app


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.sampled_from([0, 1, SEND_PIECE - 1, SEND_PIECE, SEND_PIECE + 1, 3 * SEND_PIECE + 7])
        | st.integers(0, 3 * SEND_PIECE),
        min_size=1,
        max_size=3,
    )
)
def test_a_body_goes_whole_in_pieces_its_stream_open_until_the_last(sizes: list[int]) -> None:
    bodies = [bytes([index % 251]) * size for index, size in enumerate(sizes)]
    messages: list[Message] = [{"type": "http.response.start", "status": 200, "headers": []}]
    for index, body in enumerate(bodies):
        last = index == len(bodies) - 1
        messages.append({"type": "http.response.body", "body": body, "more_body": not last})
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    aborted: list[bool] = []
    app = sending_within(_app(messages), 5.0, lambda: aborted.append(True))
    asyncio.run(_run(app, send))
    pieces = [m for m in sent if m["type"] == "http.response.body"]
    assert b"".join(m["body"] for m in pieces) == b"".join(bodies)
    assert all(len(m["body"]) <= SEND_PIECE for m in pieces)
    assert [m["more_body"] for m in pieces] == [True] * (len(pieces) - 1) + [False]
    assert not aborted


def test_a_piece_not_taken_in_time_resets_the_connection_and_ends_the_app_quietly() -> None:
    body = b"x" * (2 * SEND_PIECE)
    messages: list[Message] = [
        {"type": "http.response.start", "status": 200, "headers": []},
        {"type": "http.response.body", "body": body},
    ]
    taken: list[int] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and taken:
            await asyncio.Event().wait()  # the client takes the first piece, then nothing
        if message["type"] == "http.response.body":
            taken.append(len(message["body"]))

    aborted: list[bool] = []
    app = sending_within(_app(messages), 0.05, lambda: aborted.append(True))
    asyncio.run(_run(app, send))
    assert taken == [SEND_PIECE] and aborted == [True]
