"""What a REST route answers, whichever process serves it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    """What a route answers: a status and a JSON document, or an empty body (None)."""

    status: int
    document: Any = None
    binary: tuple[bytes, ...] = ()  # binary data following the JSON document, in order
    request_id: str = ""  # an infer request's id, for the request log
    model_version: str = ""  # the version that answered an infer request
    events: AsyncGenerator[bytes, None] | None = None  # server-sent events, in place of a body
    # What says the client of a stream left, when its route reads the request itself (None:
    # the request's own receive).
    gone: Callable[[], Awaitable[Any]] | None = None
    close: bool = False  # its connection closes after it (HTTP/1.1: a body left unread)


OK = Reply(200)
