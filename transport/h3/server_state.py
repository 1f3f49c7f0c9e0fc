"""What /metrics and the Control service read of HTTP/3: one H3Server, or the sum of every
front-end's (service/frontends/stats.py)."""

from __future__ import annotations

from typing import Protocol

from transport.h3.server import H3ServerStats
from transport.tls.session_tickets import TicketCounters


class CountedTickets(Protocol):
    @property
    def counters(self) -> TicketCounters: ...


class H3State(Protocol):
    @property
    def stats(self) -> H3ServerStats: ...

    @property
    def tickets(self) -> CountedTickets | None: ...

    def peak_send_buffered(self) -> int: ...

    def blocked_writers(self) -> int: ...
