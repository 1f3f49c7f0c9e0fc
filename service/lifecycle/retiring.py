"""Ending a version: it finishes what it holds (bounded), then its batcher and workers stop
and its verified copy goes, whether it was replaced, unloaded or failed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from service.lifecycle.verified_copies import drop_copy
from service.registry.versions import ServedVersion, VersionState

log = logging.getLogger("paddlequic.models")
RETIRE_TIMEOUT_S = 60.0

# Lifecycle.fail: the one way a version fails (the version, the reason, the load-failure
# counter's stage or None), given to the parts of the lifecycle that find failures.
Fail = Callable[[ServedVersion, str, str | None], Awaitable[None]]


async def wind_down(served: ServedVersion, over: asyncio.Event | None = None) -> None:
    """Let a version finish what it holds (bounded, and no longer once `over` is set), then
    stop its batcher and workers and drop its verified copy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETIRE_TIMEOUT_S
    batcher = served.batcher or served.sequences
    over = over or asyncio.Event()
    while (
        loop.time() < deadline
        and not over.is_set()
        and (
            served.active
            or served.held_elsewhere
            or (batcher and (batcher.queued or batcher.in_flight_requests))
            # A replaced version keeps its live sequences until they end or expire.
            or (served.sequences and served.sequences.live)
        )
    ):
        await asyncio.sleep(0.01)
    if batcher is not None:
        await batcher.stop()
    await asyncio.gather(*(i.stop() for i in served.instances), return_exceptions=True)
    drop_copy(served)


class Retiring:
    """Versions that were replaced or unloaded, winding down."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        # Set at shutdown: the server's grace for its calls is over, so what a replaced version
        # still holds is failed now rather than waited for (up to RETIRE_TIMEOUT_S).
        self._over = asyncio.Event()

    def retire_soon(
        self, versions: Sequence[ServedVersion], why: str, then: Callable[[], None] | None = None
    ) -> None:
        """Retire `versions` in the background, then call `then` (what their files need)."""
        task = asyncio.get_running_loop().create_task(self._retire_all(versions, why, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire_all(
        self, versions: Sequence[ServedVersion], why: str, then: Callable[[], None] | None
    ) -> None:
        await asyncio.gather(*(self.retire(v, why) for v in versions))
        if then is not None:
            then()

    async def retire(self, served: ServedVersion, why: str) -> None:
        """UNLOADING while it winds down, then UNAVAILABLE for `why`."""
        if served.state is VersionState.READY:
            served.state = VersionState.UNLOADING
        await wind_down(served, self._over)
        if served.state is VersionState.UNLOADING:
            served.state, served.reason = VersionState.UNAVAILABLE, why
        log.info("model %s version %d %s; its workers stopped", served.name, served.version, why)

    async def finish(self) -> None:
        """End every retirement under way now (at shutdown, once the grace is over)."""
        self._over.set()
        for task in list(self._tasks):
            await task
