"""What /metrics and the Control service read of HTTP/3: one H3Server, or the sum of every
front-end's (service/frontends/stats.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from transport.tls.session_tickets import TicketCounters


@dataclass
class H3ServerStats:
    connections: int = 0
    calls: int = 0
    rejected_streams: int = 0
    peak_send_buffered: int = 0
    # Also address tokens (transport/h3/address_tokens.py): "new_token_issued", and the
    # verdict on each one presented, "new_token_" + valid, expired, other_address, unreadable.
    handshakes: dict[str, int] = field(default_factory=dict)
    # "connections", "connections_per_address": new connections refused at a limit;
    # "handshake_timeout": dropped before completing the handshake; "metadata": streams
    # refused for a header block over the limit; "receive_budget": streams refused because
    # their address, or all addresses, reserved the whole receive budget (receive_budget.py);
    # "retry": Retry packets sent.
    refusals: dict[str, int] = field(default_factory=dict)


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
