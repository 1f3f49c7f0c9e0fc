"""`auto://HOST:PORT`: a channel that starts on HTTP/2, learns from its responses' `alt-svc`
that HTTP/3 answers too, and moves new calls there once an HTTP/3 handshake completed; where UDP
is blocked it stays on HTTP/2, and tries again once the remembered failure expired. Generated
stubs take it as they take a grpc.aio channel or a QuicChannel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

from clients.quic_channel import QuicChannel
from clients.transport_policy import TransportPolicy
from transport.grpc.alt_svc import HEADER

# How long a new HTTP/3 connection gets to complete its handshake before HTTP/2 starts too
# (browsers give QUIC a head start of this order), and before HTTP/3 counts as blocked.
RACE_DELAY_S = 0.25
H3_HANDSHAKE_TIMEOUT_S = 3.0
# An HTTP/3 connection silent this long while calls are in flight (a PING unanswered) is given
# up, so that new calls go to HTTP/2 soon when UDP gets blocked mid-connection (QuicChannel's
# own default, 10 s, is for a channel that has nowhere else to go).
H3_UNRESPONSIVE_S = 2.0


class AutoChannel:
    """`h2` is a grpc.aio channel to the origin; `open_h3(host, port)` makes the QuicChannel
    for an advertised endpoint (with `unresponsive_timeout_s=H3_UNRESPONSIVE_S`, say). `policy`
    may be shared by the channels of a process.

    A call made while no transport is known to work on a new channel (HTTP/3 advertised, not
    yet connected) waits for a race: HTTP/3 first, HTTP/2 as well if HTTP/3 has not completed
    its handshake after `race_delay_s`; it goes to whichever answered first. An HTTP/3
    handshake that has not completed after `h3_timeout_s` is a failure the policy remembers."""

    def __init__(
        self,
        h2: Any,
        open_h3: Callable[[str, int], QuicChannel],
        origin_host: str,
        policy: TransportPolicy | None = None,
        race_delay_s: float = RACE_DELAY_S,
        h3_timeout_s: float = H3_HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.policy = policy or TransportPolicy()
        self.h2 = h2  # where calls go until HTTP/3 is known to answer
        self._open_h3 = open_h3
        self._origin = origin_host
        self._race_delay_s = race_delay_s
        self._h3_timeout_s = h3_timeout_s
        self._h3: QuicChannel | None = None
        self._h3_endpoint: tuple[str, int] | None = None
        self._h3_ready = False
        self._h2_answered = False
        self._attempt: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._last_transport = "h2"

    @property
    def transport(self) -> str:
        """What the last call went over: `h2` or `h3` (`h2` before any)."""
        return self._last_transport

    @property
    def last_connect_mode(self) -> str | None:
        """How the HTTP/3 connection started (QuicChannel.last_connect_mode), when the last
        call went over it."""
        if self._last_transport != "h3" or self._h3 is None:
            return None
        return self._h3.last_connect_mode

    def pick(self) -> Any | None:
        """The channel a new call takes now; None while the race for a new connection runs.
        An HTTP/3 connection stays in use while it lives (the advertisement's lifetime is for
        new connections: HTTP/3 responses do not renew it); once it ended, the next call is a
        new connection's."""
        if self._h3_ready and self._h3 is not None and self._h3.connected:
            return self._h3
        endpoint = self.policy.h3_endpoint(self._origin)
        if endpoint != self._h3_endpoint or self._h3_ready:
            self._drop_h3()
        if endpoint is None:
            return self.h2
        if self._attempt is None:
            self._h3_endpoint = endpoint
            self._h3 = self._open_h3(*endpoint)
            self._attempt = asyncio.get_running_loop().create_task(self._connect_h3(self._h3))
        return self.h2 if self._h2_answered else None

    async def race(self) -> Any:
        """The channel for a call made while `pick` had none: whichever transport answers
        first (HTTP/2 starting after the delay)."""
        attempt = self._attempt
        if attempt is not None and not attempt.done():
            await asyncio.wait({attempt}, timeout=self._race_delay_s)
        if attempt is not None and not attempt.done():
            h2_ready = asyncio.ensure_future(self.h2.channel_ready())
            try:
                await asyncio.wait({attempt, h2_ready}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                h2_ready.cancel()
            if h2_ready.done() and not h2_ready.cancelled() and h2_ready.exception() is None:
                self._h2_answered = True
        return self.pick() or self.h2

    async def _connect_h3(self, channel: QuicChannel) -> None:
        try:
            await asyncio.wait_for(channel.channel_ready(), self._h3_timeout_s)
        except Exception:  # a timeout, UDP refused, a certificate refused: not HTTP/3 here
            self.policy.h3_failed()
            if self._h3 is channel:
                self._drop_h3()
            else:
                await channel.close()
            return
        self.policy.h3_worked()
        self._h3_ready = self._h3 is channel

    def _drop_h3(self) -> None:
        """Forget the HTTP/3 channel (its advertisement expired, changed, or it failed); its
        calls in flight finish, new ones go elsewhere."""
        channel, attempt = self._h3, self._attempt
        self._h3, self._h3_endpoint, self._h3_ready, self._attempt = None, None, False, None
        if attempt is not None and not attempt.done() and attempt is not asyncio.current_task():
            attempt.cancel()
        if channel is not None:
            self._spawn(channel.close())

    def started(self, target: Any, call: Any) -> None:
        """A call started on `target`. An HTTP/2 call's response headers are read when they
        come: their `alt-svc` teaches the policy, and they show that HTTP/2 answers."""
        if target is self.h2:
            self._last_transport = "h2"
            self._spawn(self._learn(call))
        else:
            self._last_transport = "h3"

    async def _learn(self, call: Any) -> None:
        with contextlib.suppress(Exception):
            headers = await call.initial_metadata()
            value = next((v for k, v in headers or () if k == HEADER), None)
            if value is not None:
                self._h2_answered = True
                self.policy.learn(str(value))

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def channel_ready(self) -> None:
        channel = self.pick() or await self.race()
        await channel.channel_ready()

    async def close(self, grace: float | None = None) -> None:
        """Closes both channels; closing HTTP/2's ends its calls, and so the reading of their
        headers."""
        attempt, channel = self._attempt, self._h3
        self._attempt, self._h3 = None, None
        if attempt is not None:
            attempt.cancel()
        if channel is not None:
            await channel.close()
        await self.h2.close()
        await asyncio.gather(
            *self._background, *[attempt] if attempt else [], return_exceptions=True
        )

    async def __aenter__(self) -> AutoChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # grpc.aio.Channel's four kinds of method, as the generated stubs ask for them.
    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> _MultiCallable:
        return _MultiCallable(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> _MultiCallable:
        return _MultiCallable(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> _MultiCallable:
        return _MultiCallable(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> _MultiCallable:
        return _MultiCallable(self, "stream_stream", method, args, kwargs)


class _MultiCallable:
    """Starts each call on the channel `AutoChannel.pick` names at that moment."""

    def __init__(
        self, channel: AutoChannel, kind: str, method: str, args: Any, kwargs: Any
    ) -> None:
        self._channel = channel
        self._make: Callable[[Any], Any] = lambda target: getattr(target, kind)(
            method, *args, **kwargs
        )
        self._made: dict[int, Any] = {}  # per underlying channel (id), made once

    def __call__(self, request: Any = None, **kwargs: Any) -> Any:
        target = self._channel.pick()
        if target is None:
            return _PendingCall(self, request, kwargs)
        return self.start(target, request, kwargs)

    def start(self, target: Any, request: Any, kwargs: Any) -> Any:
        made = self._made.get(id(target))
        if made is None or made[0] is not target:
            if len(self._made) > 1:  # HTTP/2's and the current HTTP/3 channel's, no others
                self._made.clear()
            made = self._made[id(target)] = (target, self._make(target))
        call = made[1](request, **kwargs)
        self._channel.started(target, call)
        return call

    async def start_after_race(self, request: Any, kwargs: Any, deadline: float | None) -> Any:
        target = await self._channel.race()
        if deadline is not None:
            kwargs = {**kwargs, "timeout": max(deadline - asyncio.get_running_loop().time(), 0)}
        return self.start(target, request, kwargs)


class _PendingCall:
    """A call made during the race: it starts on the winner, its deadline counting from now."""

    def __init__(self, multicallable: _MultiCallable, request: Any, kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        timeout: float | None = kwargs.get("timeout")
        self._deadline = deadline = None if timeout is None else loop.time() + timeout
        self._started = loop.create_task(multicallable.start_after_race(request, kwargs, deadline))

    async def _call(self) -> Any:
        return await asyncio.shield(self._started)

    def __await__(self) -> Generator[Any, None, Any]:
        return self._response().__await__()

    async def _response(self) -> Any:
        return await (await self._call())

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        async for message in await self._call():
            yield message

    async def read(self) -> Any:
        return await (await self._call()).read()

    async def write(self, request: Any) -> None:
        await (await self._call()).write(request)

    async def done_writing(self) -> None:
        await (await self._call()).done_writing()

    async def initial_metadata(self) -> Any:
        return await (await self._call()).initial_metadata()

    async def trailing_metadata(self) -> Any:
        return await (await self._call()).trailing_metadata()

    async def code(self) -> Any:
        return await (await self._call()).code()

    async def details(self) -> Any:
        return await (await self._call()).details()

    async def wait_for_connection(self) -> None:
        await (await self._call()).wait_for_connection()

    def cancel(self) -> bool:
        if self._started.done() and not self._started.cancelled():
            return bool(self._started.result().cancel())
        return self._started.cancel()

    def cancelled(self) -> bool:
        if self._started.done() and not self._started.cancelled():
            return bool(self._started.result().cancelled())
        return self._started.cancelled()

    def done(self) -> bool:
        return self.cancelled() or (self._started.done() and self._started.result().done())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        def started(task: asyncio.Task[Any]) -> None:
            if task.cancelled():
                callback(self)
            else:
                task.result().add_done_callback(callback)

        self._started.add_done_callback(started)

    def time_remaining(self) -> float | None:
        if self._started.done() and not self._started.cancelled():
            remaining: float | None = self._started.result().time_remaining()
            return remaining
        if self._deadline is None:
            return None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)
