"""The limits the front-ends keep together: each counts what it holds in a segment the parent
makes (transport/host_tally.py) and checks a limit against its own count plus the others', so
`--h3-max-connections`, `--h3-max-connections-per-address`, the receive budgets and
`--max-concurrent-rpcs` (HTTP/2, HTTP/3 and REST) hold for the host, not for each front-end."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.settings import ServerSettings
from transport.h3 import admission as h3
from transport.host_tally import (
    HostTally,
    ScopedTally,
    TallyLayout,
    clear_block,
    create,
    slots_for,
)

H3_SCOPES = 2  # HTTP/3 on the gRPC port, and on the REST port when that is another
REST_REQUESTS = H3_SCOPES * h3.COUNTERS  # the counters after the HTTP/3 ones
H2_RPCS = REST_REQUESTS + 1
REST_BODIES = H2_RPCS + 1  # what the REST requests' bodies hold (service/http/body_budget.py)
COUNTERS = REST_BODIES + 1
REFUSED = "Concurrent RPC limit exceeded"  # grpc.aio's words, and HTTP/3's


def tally_layout(settings: ServerSettings, frontends: int) -> TallyLayout:
    """Room in each front-end's table for an address per connection it may hold on either
    HTTP/3 port (more than the limit by what the others admit at the same instant), and on
    the REST port (an address whose requests' bodies hold part of the receive budget)."""
    entries = H3_SCOPES * (settings.h3_max_connections + frontends)
    entries += settings.http_max_connections + frontends
    return TallyLayout(frontends, COUNTERS, slots_for(entries), h3.COLUMNS)


class ParentTally:
    """The parent's hold on the segment: made before the first front-end starts, each dead
    front-end's counts cleared before its successor starts (the block's one writer then)."""

    def __init__(self, settings: ServerSettings, frontends: int) -> None:
        self.layout = tally_layout(settings, frontends)
        self.fd = create(self.layout)

    def ended(self, index: int) -> None:
        clear_block(self.fd, self.layout, index)

    def close(self) -> None:
        os.close(self.fd)


class FrontendTally:
    """A front-end's end of the segment."""

    def __init__(self, fd: int, settings: ServerSettings, frontends: int, index: int) -> None:
        self._tally = HostTally(fd, tally_layout(settings, frontends), index)
        os.close(fd)  # mapped: the descriptor is not needed any more

    def h3(self, scope: int) -> ScopedTally:
        return ScopedTally(self._tally, scope, scope * h3.COUNTERS)

    def rest(self) -> ScopedTally:
        return ScopedTally(self._tally, H3_SCOPES, REST_REQUESTS)

    def rest_bodies(self) -> ScopedTally:
        """The REST receive budget's: its counter, and the REST port's per-address entries."""
        return ScopedTally(self._tally, H3_SCOPES, REST_BODIES)

    def h2_rpcs(self, limit: int) -> RpcCount:
        return RpcCount(ScopedTally(self._tally, H3_SCOPES, H2_RPCS), limit)


class RpcCount:
    """The gRPC calls a front-end's HTTP/2 handlers run, against --max-concurrent-rpcs for
    the host: grpc.aio's own count (`maximum_concurrent_rpcs`) is the process's alone."""

    def __init__(self, host: ScopedTally, limit: int) -> None:
        self._host = host
        self._limit = limit
        self._running = 0

    @contextlib.asynccontextmanager
    async def admitted(self, context: Any) -> AsyncIterator[None]:
        """The call counted while it runs; refused (`context.abort`) at the limit."""
        if self._running + self._host.others(0) >= self._limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSED)
        self._running += 1
        self._host.set(0, self._running)
        try:
            yield
        finally:
            self._running -= 1
            self._host.set(0, self._running)
