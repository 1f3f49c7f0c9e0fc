"""The event loop the front-end runs on. uvloop (libuv) does the loop's own work (ready
callbacks, timers, socket readiness) in C; it cut the server's CPU per HTTP/2 ModelInfer by
4-10% at concurrency 64, in alternating rounds (grpcio's aio server and the worker sockets keep
the loop busy)."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable

EVENT_LOOPS = ("auto", "asyncio", "uvloop")


class EventLoopUnavailable(RuntimeError):
    """The event loop asked for cannot run here."""


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The loop's name and how to make it (None: asyncio's default). `auto`: uvloop where it is
    installed (the server extra installs it), else asyncio's."""
    if choice == "asyncio":
        return "asyncio", None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            raise EventLoopUnavailable(
                "--event-loop uvloop: uvloop is not installed (pip install 'paddlequic[server]')"
            ) from None
        return "asyncio", None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return "uvloop", factory
