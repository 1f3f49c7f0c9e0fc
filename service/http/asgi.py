"""ASGI for this package's apps: its shapes, a request's headers read, and the lifespan protocol
answered for an app that needs no start-up or shutdown of its own."""

from __future__ import annotations

from transport.asgi import App, Message, Receive, Scope, Send

__all__ = ["App", "Message", "Receive", "Scope", "Send", "header", "lifespan"]


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def header(scope: Scope, wanted: bytes) -> str | None:
    """A header's value (the first, if sent more than once); ASGI names are lower case."""
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value).decode("latin-1")
    return None
