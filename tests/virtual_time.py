"""An event loop with an injected clock, for tests of code that times itself with loop.time()
and loop.call_at (the batcher's queue timeouts and deadlines, timers.fail_at): the clock moves
only when every task is waiting for a timer, and then jumps straight to the next one. A timeout
therefore fires after everything that could run before it has run, however slow the machine,
and a test of a 600 s timeout takes no time.

Use it in a test module with:

    @pytest.fixture(scope="module")
    def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
        return VirtualTimePolicy()
"""

from __future__ import annotations

import asyncio
import selectors


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


# How long (real time) a loop with no timer waits for I/O before it calls itself deadlocked.
DEADLOCK_S = 30.0


class Deadlock(RuntimeError):
    pass


class _JumpingSelector(selectors.DefaultSelector):
    """Looks for I/O without waiting; where the loop would sleep until its next timer, the
    clock jumps there instead. With no timer the loop waits for I/O (a thread's
    call_soon_threadsafe, a socket), and when none comes the test fails by name: every task
    waits for something that nothing will do."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            events = super().select(DEADLOCK_S)
            if not events:
                raise Deadlock(
                    f"every task waits, no timer is set and no I/O came in {DEADLOCK_S} s"
                )
            return events
        events = super().select(0)
        if not events and timeout > 0:
            self._clock.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(_JumpingSelector(self._clock))

    def time(self) -> float:
        return self._clock.now


class VirtualTimePolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return VirtualTimeLoop()
